"""The per-layer curves of `lens --prompts --plot`: one panel per statistic against layer.

matplotlib is optional (`pip install 'embedlens[plot]'`) and imported only inside the functions.
PNG and SVG are written by matplotlib; HTML is a page holding the SVG (no network fetches).
"""

from __future__ import annotations

import html
import io
from pathlib import Path
from typing import Any

from embedlens.reports.lens import LensSummaryReport
from embedlens.views.format import lens_name
from embedlens.views.heatmap import write_plot

PANELS = (
    ("kl", "KL(output ‖ lens), nats", False),
    ("entropy", "entropy of the lens, nats", False),
    ("top1_agreement", "top-1 agrees with the output", False),
    ("target_prob", "p(target)", False),
    ("target_logprob", "log p(target)", False),
    ("target_rank_median", "median rank of the target", True),
)
"""(statistic, axis label, log scale)."""


def figure(report: LensSummaryReport) -> Any:
    """The curves as a matplotlib Figure: one panel per statistic that has values."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    layers = [row.layer for row in report.layers]
    panels = [
        (key, label, log)
        for key, label, log in PANELS
        if all(getattr(row, key) is not None for row in report.layers)
    ]
    cols = min(3, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    for ax, (key, label, log) in zip(axes.flat, panels, strict=False):
        ax.plot(layers, [getattr(row, key) for row in report.layers], marker="o", markersize=3)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("layer (0 = embedding output)")
        ax.grid(alpha=0.3)
        if log:
            ax.set_yscale("log")
        if key == "top1_agreement":
            ax.set_ylim(-0.03, 1.03)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    title = fig.suptitle(_title(report), fontsize=11)
    title.set_parse_math(False)
    fig.tight_layout()
    return fig


def _title(report: LensSummaryReport) -> str:
    where = "last position" if report.position == -1 else f"positions: {report.position}"
    return (
        f"{lens_name(report)} of {report.display_model} over {report.n_prompts} prompts "
        f"({report.n_positions} positions read, {where})"
    )


def _drawn(report: LensSummaryReport, fmt: str) -> bytes:
    import matplotlib
    import matplotlib.pyplot as plt

    with matplotlib.rc_context({"svg.fonttype": "none"}):
        fig = figure(report)
        try:
            buffer = io.BytesIO()
            fig.savefig(buffer, format=fmt, dpi=150)
            return buffer.getvalue()
        finally:
            plt.close(fig)


def save_curves(report: LensSummaryReport, path: Path) -> None:
    """Write the curves to `path`: .png, .svg, or .html (the SVG inside a page)."""
    suffix = path.suffix.lower()
    if suffix != ".html":
        write_plot(path, _drawn(report, suffix.lstrip(".")))
        return
    svg = _drawn(report, "svg").decode("utf-8")
    title = html.escape(_title(report))
    page = (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>{title}</title></head>\n<body style='font-family: sans-serif'>\n"
        f"<h1 style='font-size: 1.2em'>{title}</h1>\n{svg[svg.index('<svg') :]}\n</body></html>\n"
    )
    write_plot(path, page.encode("utf-8"))
