"""How `lens --text` is shown: a row per layer of statistics over the scored tokens, with a
comparison llama-perplexity's KL table per layer and its perplexity lines; --plot's curves."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

from embedlens.reports import register_view
from embedlens.reports.lens_text import (
    LensTextReport,
    TextLayer,
    TextPairLayer,
    TextSiteLayer,
    TextSitePairLayer,
)
from embedlens.views.format import Sheet, lens_name, shown
from embedlens.views.lens import row_label, sums_line


def _over(r: LensTextReport) -> str:
    return (
        f"{r.n_scored:,} tokens scored in {r.n_windows} windows of {r.ctx} (stride {r.stride}, "
        f"score {r.score}) of {r.text}, {r.dtype}"
    )


def render(r: LensTextReport) -> RenderableType:
    """The per-layer table; with a comparison, the KL table and the perplexity lines."""
    parts: list[RenderableType] = [_one(r)]
    if r.pair is not None:
        parts.append(_pair(r))
    if r.pair_output is not None:
        o = r.pair_output
        lines = [
            f"Mean PPL(Q)                   : {o.ppl_evaluated:10.6f} ± {o.ppl_evaluated_err:10.6f}",
            f"Mean PPL(base)                : {o.ppl_reference:10.6f} ± {o.ppl_reference_err:10.6f}",
            f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * o.cor:6.2f}%",
            f"Mean ln(PPL(Q)/PPL(base))     : {o.ln_ratio:10.6f} ± {o.ln_ratio_err:10.6f}",
            f"Mean PPL(Q)/PPL(base)         : {o.ratio:10.6f} ± {o.ratio_err:10.6f}",
            f"Mean PPL(Q)-PPL(base)         : {o.diff:10.6f} ± {o.diff_err:10.6f}",
        ]
        parts.append(Text("\n".join(lines)))
    return Group(*parts)


def _one(r: LensTextReport) -> RenderableType:
    name = lens_name(r)
    title = f"{name} of {r.display_model} over a text: {_over(r)}"
    sites = r.sites is not None
    if r.sites is not None:
        title += f"; sites {', '.join(r.sites)}"
    table = Sheet(title=shown(title, "table.title"))
    cols = ["layer", "CE (nats)", "± ", "bits/byte", "KL to output", "entropy", "top-1 acc"]
    ranked = any(row.next_rank_median is not None for row in r.layers)
    cols += ["median rank"] if ranked else []
    logit = {row.layer: row for row in r.logit_layers or []}
    if logit:
        cols += ["logit CE", "logit KL", "logit top-1"]
    for c in cols:
        table.add_column(c, justify="right", no_wrap=c == "layer")
    for row in r.layers:
        cells = [_row(r, row), f"{row.cross_entropy:.3f}", f"{row.cross_entropy_err:.3f}",
                 f"{row.bits_per_byte:.3f}", f"{row.kl:.3f}", f"{row.entropy:.3f}",
                 f"{row.top1_accuracy:.1%}"]  # fmt: skip
        rank = row.next_rank_median
        cells += [("-" if rank is None else format(rank, "g"))] if ranked else []
        other = logit.get(row.layer)
        if other is not None:
            cells += [f"{other.cross_entropy:.3f}", f"{other.kl:.3f}", f"{other.top1_accuracy:.1%}"]
        table.add_row(*cells, end_section=sites and getattr(row, "site", "") == "resid")
    line = (
        f"PPL {r.perplexity:.4f} ± {r.perplexity_err:.4f} at the output; CE: -ln p(true next "
        "token), KL(model's output ‖ lens) and entropy in nats, means over the scored tokens."
    )
    if ranked:
        line += " Median rank: of the true next token by the lens's logits (1 = top)."
    if sites:
        line += " attn_out and mlp_out rows: the piece decoded directly."
    parts: list[RenderableType] = [table, Text(line, style="dim")]
    if r.block_sums is not None:
        parts.append(sums_line(r.block_sums, reads=False))
    return Group(*parts)


def _row(r: LensTextReport, row: TextLayer | TextPairLayer) -> str:
    """A row's label: its layer (the embedding and the output named), or its (layer, site)
    with --site."""
    if isinstance(row, TextSiteLayer | TextSitePairLayer):
        return row_label(row, r.num_layers)
    if row.layer == 0:
        return "0 emb"
    return f"{row.layer} out" if row.layer == r.num_layers else str(row.layer)


def _pair(r: LensTextReport) -> RenderableType:
    """llama-perplexity's KL table per layer, then its token probability figures per layer."""
    assert r.pair is not None
    kl = Sheet(title=shown(f"KL(base ‖ Q) per layer: base {r.reference}, Q {r.evaluated}",
                           "table.title"))  # fmt: skip
    for c in ("layer", "mean KLD", "median", "90%", "99%", "99.9%", "max"):
        kl.add_column(c, justify="right", no_wrap=c == "layer")
    residual = r.pair[0].residual_kl is not None
    probs = Sheet(title=shown("Same top token and Δp of the true next token per layer",
                              "table.title"))  # fmt: skip
    cols = ["layer", "same top", "mean Δp", "RMS Δp", "ln PPL(Q)/PPL(base)"]
    for c in [*cols, *(["residual KL"] if residual else [])]:
        probs.add_column(c, justify="right", no_wrap=c == "layer")
    for p in r.pair:
        q = p.kl_percentiles
        end = isinstance(p, TextSitePairLayer) and p.site == "resid"
        kl.add_row(_row(r, p), f"{p.kl:.6f} ± {p.kl_err:.6f}",
                   *(f"{q[k]:.6f}" for k in ("median", "90", "99", "99.9", "max")),
                   end_section=end)  # fmt: skip
        cells = [_row(r, p), f"{100 * p.same_top:.3f} ± {100 * p.same_top_err:.3f}%",
                 f"{100 * p.dp_mean:.3f}%", f"{100 * p.dp_rms:.3f} ± {100 * p.dp_rms_err:.3f}%",
                 f"{p.ln_ppl_ratio:.6f} ± {p.ln_ppl_ratio_err:.6f}"]  # fmt: skip
        if residual:
            cells.append("" if p.residual_kl is None else f"{p.residual_kl:.6f}")
        probs.add_row(*cells, end_section=end)
    line = (
        "llama-perplexity's definitions at every layer (docs/text.md): KL in nats; Δp = "
        "p_Q(true token) - p_base(true token)."
    )
    if r.sites is not None:
        line += " Each model's site rows through its own lens; residual KL: resid rows alone."
    return Group(kl, probs, Text(line, style="dim"))


def figure(r: LensTextReport) -> Any:
    """The curves: CE, KL to the output, top-1 accuracy; with a comparison, KL(base ‖ Q)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    def curves(rows: Any, get: Callable[[Any], float]) -> list[tuple[str, list[int], list[float]]]:
        by_site: dict[str, list[Any]] = {}
        for row in rows:  # with --site, a curve per site
            by_site.setdefault(getattr(row, "site", ""), []).append(row)
        return [(site, [x.layer for x in each], [get(x) for x in each])
                for site, each in by_site.items()]  # fmt: skip

    panels = [
        ("cross-entropy, nats", curves(r.layers, lambda x: x.cross_entropy), "linear"),
        ("KL(output ‖ lens), nats", curves(r.layers, lambda x: x.kl), "symlog"),
        ("top-1 accuracy", curves(r.layers, lambda x: x.top1_accuracy), "linear"),
    ]
    if r.pair is not None and len(r.pair) > 1:
        panels.append(("mean KL(base ‖ Q), nats", curves(r.pair, lambda p: p.kl), "log"))
        q99 = curves(r.pair, lambda p: p.kl_percentiles["99"])
        panels.append(("99% KL(base ‖ Q), nats", q99, "log"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (label, lines, scale) in zip(axes.flat, panels, strict=True):
        for site, xs, ys in lines:
            ax.plot(xs, ys, marker="o", markersize=3, label=site or None)
        if len(lines) > 1:
            ax.legend(fontsize=7)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("layer (0 = embedding output)")
        ax.grid(alpha=0.3)
        if scale == "symlog":
            ax.set_yscale("symlog", linthresh=0.01)
        elif scale == "log" and all(y > 0 for _, _, ys in lines for y in ys):
            ax.set_yscale("log")
    title = fig.suptitle(f"{r.display_model}: {_over(r)}", fontsize=10)
    title.set_parse_math(False)
    fig.tight_layout()
    return fig


def save_text_curves(r: LensTextReport, path: Path) -> None:
    """Write the curves to `path` (.png, .svg or .html)."""
    from embedlens.views.curves import save_figure

    save_figure(lambda: figure(r), f"{r.display_model}: {_over(r)}", path)


register_view(LensTextReport, render)
