"""How a parity run is shown: a row per layer (the residual streams' distance, the lenses' KL),
then the output's δ lines and the tokens that moved most; --plot's curve by depth."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

from embedlens.reports import register_view
from embedlens.reports.lens_parity import LensParityReport, ParityLayer, ParitySide
from embedlens.views.format import Sheet, quoted, shown


def _side(s: ParitySide) -> str:
    how = f"{s.dtype}, head {s.head_dtype}" if s.head_dtype != s.dtype else s.dtype
    return f"{s.name} ({s.source}, {how})"


def _pct(x: float) -> str:
    return f"{100 * x:.3f}%"


def _kl(x: float | None) -> str:
    return "-" if x is None else format(x, ".3g")


def _label(r: LensParityReport, row: ParityLayer) -> str:
    mark = " ◀" if row.layer == r.first_divergent_layer else ""
    if row.layer == 0:
        return "0 emb" + mark
    return (f"{row.layer} last" if row.layer == r.num_layers else str(row.layer)) + mark


def render(r: LensParityReport) -> RenderableType:
    """The per-layer table, then the output lines and the worst tokens."""
    title = (
        f"Parity of A = {_side(r.a)} against B = {_side(r.b)}: {r.n_tokens:,} positions of "
        f"{r.n_sequences} sequence(s)"
    )
    table = Sheet(title=shown(title, "table.title"))
    cols = [
        "layer",
        "RMS rel mean",
        "median",
        "max",
        "cos mean",
        "cos min",
        "KL(A‖B)",
        "residual KL",
        "top-1 agree",
        "worst at",
    ]
    for c in cols:
        table.add_column(c, justify="left" if c == "worst at" else "right", no_wrap=True)
    for row in r.layers:
        w = row.worst
        at = Text.assemble(f"{w.sequence}:{w.position} ", quoted(w.token))
        agree = "-" if row.top1_agree is None else f"{row.top1_agree:.1%}"
        table.add_row(
            _label(r, row),
            _pct(row.rms_rel_mean),
            _pct(row.rms_rel_median),
            _pct(row.rms_rel_max),
            f"{row.cosine_mean:.6f}",
            f"{row.cosine_min:.6f}",
            _kl(row.kl),
            _kl(row.residual_kl),
            agree,
            at,
        )
    first = "none" if r.first_divergent_layer is None else str(r.first_divergent_layer)
    lines = [
        f"RMS rel = ‖a − b‖ / ‖b‖ per position (a: A's residual, b: B's); first layer whose mean "
        f"exceeds {r.threshold:g}: {first} (◀). KL in nats, each side through its own tail.",
    ]
    parts: list[RenderableType] = [table, Text("\n".join(lines), style="dim")]
    if r.sites is not None:
        parts.append(_sites(r))
    if r.output is not None:
        parts.append(_output(r))
    return Group(*parts)


def _sites(r: LensParityReport) -> RenderableType:
    """--site: each site inside each block shown."""
    assert r.sites is not None
    table = Sheet(title=shown("Inside the blocks (--site)", "table.title"))
    for c in ("block", "site", "RMS rel mean", "median", "max", "cos mean", "cos min"):
        table.add_column(c, justify="left" if c == "site" else "right", no_wrap=True)
    for i, row in enumerate(r.sites):
        last = i + 1 == len(r.sites) or r.sites[i + 1].layer != row.layer
        table.add_row(
            str(row.layer),
            row.site,
            _pct(row.rms_rel_mean),
            _pct(row.rms_rel_median),
            _pct(row.rms_rel_max),
            f"{row.cosine_mean:.6f}",
            f"{row.cosine_min:.6f}",
            end_section=last,
        )
    return table


def _output(r: LensParityReport) -> RenderableType:
    o = r.output
    assert o is not None
    n = len(o.sequences)
    ratios = [s.ratio for s in o.sequences]
    lines = [
        f"Output, δ = log π_A(t) − log π_B(t) on {o.n_tokens:,} observed next tokens: mean "
        f"{o.delta_mean:.3g}, RMS {o.delta_rms:.3g}, |δ| p99 {o.delta_p99:.3g}, max "
        f"{o.delta_max:.3g}; top-1 flips {o.top1_flip:.2%}; logits RMS rel {_pct(o.logits_rms_rel_mean)}",
        f"Sequence importance ratio exp(Σ δ) over {n} sequence(s): from {min(ratios):.4g} to "
        f"{max(ratios):.4g}; {o.n_over_cap} above the cap {o.cap:g}, {o.n_under_cap} below "
        f"1/{o.cap:g}",
    ]
    worst = Sheet(title=shown("Tokens whose log-probability moved most", "table.title"))
    for c in ("sequence", "position", "next token", "|δ|"):
        worst.add_column(c, justify="left" if c != "|δ|" else "right", no_wrap=True)
    for w in o.worst:
        worst.add_row(w.sequence, str(w.position), quoted(w.token), f"{w.value:.4g}")
    return Group(Text("\n".join(lines)), worst)


def figure(r: LensParityReport) -> Any:
    """The RMS relative difference by depth: mean, median and max over the positions."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from embedlens.views.curves import layer_axis

    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = [row.layer for row in r.layers]
    for name, key in (
        ("mean", "rms_rel_mean"),
        ("median", "rms_rel_median"),
        ("max", "rms_rel_max"),
    ):
        ax.plot(x, [100 * getattr(row, key) for row in r.layers], marker=".", label=name)
    if r.first_divergent_layer is not None:
        ax.axvline(r.first_divergent_layer, color="grey", linestyle=":", label="first divergent")
    ax.set_ylabel("‖a − b‖ / ‖b‖ (%)")
    layer_axis(ax)
    ax.legend()
    ax.set_title(f"A {r.a.dtype} against B {r.b.dtype}: {r.display_model}", fontsize=10)
    fig.tight_layout()
    return fig


def save_plot(r: LensParityReport, path: Path) -> None:
    """--plot: the curve by depth, .png, .svg or .html."""
    from embedlens.views.curves import save_figure

    save_figure(lambda: figure(r), f"Parity of {r.display_model}", path)


register_view(LensParityReport, render)
