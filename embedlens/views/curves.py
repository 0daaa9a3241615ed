"""The lens's curves against layer: `lens --prompts --plot`, one panel per statistic; `lens
--against --plot`, KL(A ‖ B) and the residual KL, for one prompt or the means over many (the
y axis linear up to the divergence threshold and logarithmic above it: a KL of exactly 0 stays
on the axis), the first divergent layer marked.

matplotlib is optional (`pip install 'embedlens[plot]'`) and imported only inside the functions.
PNG and SVG are written by matplotlib; HTML is a page holding the SVG (no network fetches).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from embedlens.reports.lens import LensDiff, LensReport, LensSummaryDiff, LensSummaryReport
from embedlens.views.format import lens_name
from embedlens.views.heatmap import drawn, pyplot, write_page, write_plot

PANELS = (
    ("kl", "KL(output ‖ lens), nats (log scale)", "symlog"),
    ("entropy", "entropy of the lens, nats", "linear"),
    ("top1_agreement", "top-1 agrees with the output", "linear"),
    ("target_prob", "p(target)", "linear"),
    ("target_logprob", "log p(target)", "linear"),
    ("target_rank_median", "median rank of the target", "log"),
)
"""(statistic, axis label, y scale). KL runs from about 100 nats at the embedding to 0 at the
output: on a linear axis layer 0 flattens every later layer into the floor, so it is drawn on a
log scale that stays linear near 0 (symlog), where the output's 0 sits."""
KL_LINEAR_BELOW = 0.01
"""The symlog KL axis is linear from 0 to this many nats, logarithmic above."""


def layer_axis(ax: Any) -> None:
    """Layers along x: whole numbers, 0 the embedding output; a light grid."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("layer (0 = embedding output)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)


def _titled(fig: Any, title: str, size: int) -> Any:
    """The figure under its title (never read as mathtext), laid out tight."""
    fig.suptitle(title, fontsize=size).set_parse_math(False)
    fig.tight_layout()
    return fig


def figure(report: LensReport | LensSummaryReport) -> Any:
    """The curves as a matplotlib Figure: one panel per statistic that has values; with
    --against, A against B's (`_diff_figure`)."""
    if report.diff is not None:
        return _diff_figure(report, report.diff)
    assert isinstance(report, LensSummaryReport)
    plt = pyplot()
    panels = [
        (key, label, scale)
        for key, label, scale in PANELS
        if all(getattr(row, key) is not None for row in report.layers)
    ]
    cols = min(3, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    by_site = _by_site(report.layers)
    for ax, (key, label, scale) in zip(axes.flat, panels, strict=False):
        for site, rows in by_site.items():
            named = {} if site is None else {"label": site}
            values = [getattr(row, key) for row in rows]
            ax.plot([row.layer for row in rows], values, marker="o", markersize=3, **named)
        if len(by_site) > 1:
            ax.legend(fontsize=7)
        ax.set_title(label, fontsize=10)
        layer_axis(ax)
        if scale == "symlog":
            ax.set_yscale("symlog", linthresh=KL_LINEAR_BELOW)
            ax.set_ylim(bottom=0)
        elif scale == "log":
            ax.set_yscale("log")
        if key == "top1_agreement":
            ax.set_ylim(-0.03, 1.03)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    return _titled(fig, _title(report), 11)


def _diff_figure(report: LensReport | LensSummaryReport, d: LensDiff | LensSummaryDiff) -> Any:
    """The two curves of A against B as a matplotlib Figure, the first divergent layer marked."""
    plt = pyplot()
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
    layer_axis(ax)
    ax.set_yscale("symlog", linthresh=max(d.threshold, 1e-12))
    ax.axhline(d.threshold, color="grey", linewidth=0.8, linestyle=":")
    if d.first_divergent_layer is not None:
        ax.axvline(d.first_divergent_layer, color="red", linewidth=0.8, linestyle="--")
    ax.set_ylabel("nats")
    ax.legend(fontsize=8)
    return _titled(fig, _title(report), 10)


def _by_site(rows: list[Any]) -> dict[str | None, list[Any]]:
    """The rows of each site (`lens --site`: a curve each), in order; None: the lens's rows."""
    out: dict[str | None, list[Any]] = {}
    for row in rows:
        out.setdefault(getattr(row, "site", None), []).append(row)
    return out


def _title(report: LensReport | LensSummaryReport) -> str:
    """The figure's title: which lens read which model (against which B), over what."""
    if isinstance(report, LensReport):
        assert report.diff is not None  # one prompt draws curves only against B
        where = f"at position {report.position_index}"
    elif report.diff is None:
        read = "last position" if report.position == -1 else f"positions: {report.position}"
        return (
            f"{lens_name(report)} of {report.display_model} over {report.n_prompts} prompts "
            f"({report.n_positions} positions read, {read})"
        )
    else:
        where = f"over {report.n_prompts} prompts"
    return f"{report.display_model} (A) against {report.diff.against} (B), {where}"


def save_curves(report: LensReport | LensSummaryReport, path: Path) -> None:
    """Write the curves (`figure`) to `path`: .png, .svg, or .html (the SVG inside a page)."""
    save_figure(lambda: figure(report), _title(report), path)


def save_figure(make: Callable[[], Any], title: str, path: Path) -> None:
    """Write the matplotlib figure `make()` draws to `path`: .png, .svg, or .html (the SVG inside
    a page titled `title`); the figure is closed after."""
    suffix = path.suffix.lower()
    if suffix != ".html":
        write_plot(path, drawn(make, suffix.lstrip("."), dpi=150))
        return
    svg = drawn(make, "svg", dpi=150).decode("utf-8")
    write_page(path, title, svg[svg.index("<svg") :])
