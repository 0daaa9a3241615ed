"""How the `params` report is shown: the share table, the block parts and the head's cost."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from embedlens.reports import register_view
from embedlens.reports.params import ParamsReport
from embedlens.text import model_title
from embedlens.views.format import Sheet, count, share, shown, size

_LABELS = {
    "embedding": "embedding",
    "lm_head": "LM head",
    "position_embedding": "position embeddings",
    "blocks": "decoder blocks",
    "final_norm": "final norm",
    "other": "other",
}


def render(r: ParamsReport) -> RenderableType:
    """The share table, the block parts, and the head's cost."""
    table = Sheet(
        title=shown(f"Parameters of {model_title(r.model)} (source: {r.source})", "table.title")
    )
    table.add_column("part")
    table.add_column("params", justify="right", no_wrap=True)
    table.add_column("share", justify="right", no_wrap=True)
    table.add_column("bytes", justify="right", no_wrap=True)
    for g in r.groups:
        label = _LABELS.get(g.name, g.name)
        if g.name == "embedding" and r.tied:
            label += " (tied with the head)"
        table.add_row(shown(label), count(g.params), share(g.fraction), size(g.bytes))
        if g.name == "blocks":
            for part in r.block_parts:
                table.add_row(
                    shown("  " + part.name, style="dim"),
                    Text(count(part.params), style="dim"),
                    Text(share(part.fraction), style="dim"),
                    Text(size(part.bytes), style="dim"),
                )
    table.add_section()
    table.add_row("total", count(r.total), "100.00%", size(r.total_bytes), style="bold")
    lines: list[RenderableType] = [
        table,
        shown(
            f"V = {count(r.vocab_size)}, d = {count(r.hidden_size)}, {r.num_layers} blocks, "
            f"{'tied' if r.tied else 'untied'} head, dtype {r.dtype or '?'}."
        ),
    ]
    head = "embedding + head" if not r.tied else "embedding (= head)"
    lines.append(
        Text(
            f"{head}: {share(r.embedding_lm_head_fraction)} of all parameters. "
            f"LM head per token: 2·V·d = {count(r.head_flops_per_token)} operations, "
            f"{share(r.head_flops_fraction)} of a token's forward pass "
            "(about 2 per weight used; attention over the context aside)."
        )
    )
    if r.moe is not None:
        m = r.moe
        lines.append(
            Text(
                f"Mixture of experts: {m.experts_per_token} of {m.num_experts} experts per token; "
                f"active per token {count(m.active_params)} ({share(m.active_fraction)} of all)."
            )
        )
    if r.blocks:
        per = Sheet(title="Per block")
        for col in ("layer", "params", "attention", "mlp", "experts", "router", "norms", "other"):
            per.add_column(col, justify="right")
        for b in r.blocks:
            per.add_row(
                str(b.layer),
                *(count(x) for x in (b.params, b.attention, b.mlp, b.experts, b.router, b.norms)),
                count(b.other),
            )
        lines.append(per)
    return Group(*lines)


register_view(ParamsReport, render)
