"""`lens --against --plot`: KL(A ‖ B) and the residual KL against layer, for one prompt or the
means over many.

The y axis is linear up to the divergence threshold and logarithmic above it (a KL of exactly 0
stays on the axis). matplotlib is optional (`pip install 'embedlens[plot]'`) and imported only
inside the functions. PNG and SVG are written by matplotlib; HTML is a page holding the SVG.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from embedlens.reports.lens import LensReport, LensSummaryReport
from embedlens.views.curves import save_figure

Pair = LensReport | LensSummaryReport
"""A lens report with its `diff`."""


def figure(report: Pair) -> Any:
    """The two curves as a matplotlib Figure, the first divergent layer marked."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    d = report.diff
    assert d is not None
    layers = [row.layer for row in d.layers]
    fig, ax = plt.subplots(figsize=(7.0, 3.8))
    ax.plot(layers, [row.kl for row in d.layers], marker="o", markersize=3, label="KL(A ‖ B)")
    ax.plot(
        layers,
        [row.residual_kl for row in d.layers],
        marker="s",
        markersize=3,
        linestyle="--",
        label="residual KL (A's decoder on B's residual)",
    )
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_yscale("symlog", linthresh=max(d.threshold, 1e-12))
    ax.axhline(d.threshold, color="grey", linewidth=0.8, linestyle=":")
    if d.first_divergent_layer is not None:
        ax.axvline(d.first_divergent_layer, color="red", linewidth=0.8, linestyle="--")
    ax.set_xlabel("layer (0 = embedding output)")
    ax.set_ylabel("nats")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    title = fig.suptitle(_title(report), fontsize=10)
    title.set_parse_math(False)
    fig.tight_layout()
    return fig


def _title(report: Pair) -> str:
    where = (
        f"over {report.n_prompts} prompts"
        if isinstance(report, LensSummaryReport)
        else f"at position {report.position_index}"
    )
    assert report.diff is not None
    return f"{report.display_model} (A) against {report.diff.against} (B), {where}"


def save_diff_curves(report: Pair, path: Path) -> None:
    """Write the curves to `path`: .png, .svg, or .html (the SVG inside a page)."""
    save_figure(lambda: figure(report), _title(report), path)
