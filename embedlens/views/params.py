"""How the `params` report is shown: the share table, the block parts and the head's cost."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from embedlens.reports import register_view
from embedlens.reports.params import ParamGroup, ParamsReport
from embedlens.text import model_title
from embedlens.views.format import Sheet, count, share, shown, size

_LABELS = {
    "embedding": "embedding",
    "lm_head": "LM head",
    "position_embedding": "position embeddings",
    "blocks": "decoder blocks",
    "final_norm": "final norm",
    "towers": "vision/audio towers",
    "other": "other",
}


def render(r: ParamsReport) -> RenderableType:
    """The share table, the block parts, and the head's cost."""
    lines: list[RenderableType] = [
        _table(r),
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
    lines.extend(_parts(r))
    if r.moe is not None:
        m = r.moe
        lines.append(
            Text(
                f"Mixture of experts: {m.experts_per_token} of {m.num_experts} experts per token; "
                f"active per token {count(m.active_params)} ({share(m.active_fraction)} of all)."
            )
        )
    if r.blocks:
        lines.append(_per_block(r))
    return Group(*lines)


def _per_block(r: ParamsReport) -> Sheet:
    per = Sheet(title="Per block")
    for col in ("layer", "params", "attention", "mlp", "experts", "router", "norms", "other"):
        per.add_column(col, justify="right")
    for b in r.blocks:
        per.add_row(
            str(b.layer),
            *(count(x) for x in (b.params, b.attention, b.mlp, b.experts, b.router, b.norms)),
            count(b.other),
        )
    return per


def _table(r: ParamsReport) -> Sheet:
    """The share table: a row per group (the blocks by part), the total, the bookkeeping."""
    table = Sheet(
        title=shown(f"Parameters of {model_title(r.model)} (source: {r.source})", "table.title")
    )
    table.add_column("part")
    table.add_column("params", justify="right", no_wrap=True)
    table.add_column("share", justify="right", no_wrap=True)
    table.add_column("bytes", justify="right", no_wrap=True)
    if r.quantised:
        table.add_column("bits/param", justify="right", no_wrap=True)
        table.add_column("stored as")

    def extra(g: ParamGroup) -> list[RenderableType]:
        if not r.quantised:
            return []
        return [_bits(g.bits_per_param), shown(g.dtype or "?")]

    for g in r.groups:
        label = _LABELS.get(g.name, g.name)
        if g.name == "embedding" and r.tied:
            label += " (tied with the head)"
        table.add_row(shown(label), count(g.params), share(g.fraction), size(g.bytes), *extra(g))
        if g.name == "blocks":
            for part in r.block_parts:
                table.add_row(
                    shown("  " + part.name, style="dim"),
                    Text(count(part.params), style="dim"),
                    Text(share(part.fraction), style="dim"),
                    Text(size(part.bytes), style="dim"),
                    *extra(part),
                )
    table.add_section()
    bits = [_bits(r.total_bytes * 8 / r.total if r.total_bytes is not None else None), ""]
    table.add_row(
        "total",
        count(r.total),
        "100.00%",
        size(r.total_bytes),
        *(bits if r.quantised else []),
        style="bold",
    )
    if r.quantised:
        _bookkeeping_rows(table, r)
    return table


def _parts(r: ParamsReport) -> list[RenderableType]:
    """A line naming the parts a config's figures hide (MTP layers, towers, experts)."""
    if not r.parts:
        return []
    said = "; ".join(f"{p.name} {count(p.params)} ({share(p.params / r.total)})" for p in r.parts)
    return [shown(f"Parts: {said}.")]


def _bits(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f}"


def _bookkeeping_rows(table: Sheet, r: ParamsReport) -> None:
    """The quantisation bookkeeping, a line per kind, and the bytes stored in all."""
    for b in r.bookkeeping:
        table.add_row(
            shown(f"bookkeeping: {b.kind} ({b.tensors:,} tensors)", style="dim"),
            "",
            "",
            Text(size(b.bytes), style="dim"),
            "",
            "",
        )
    if not r.bookkeeping and r.bookkeeping_bytes is None:
        table.add_row(shown("bookkeeping", style="dim"), "", "", "?", "", "")
    table.add_row("stored in all", "", "", size(r.stored_bytes), "", "", style="bold")


register_view(ParamsReport, render)
