"""How a lens report's `sites` part is shown: a row per (layer, site), what each piece does to
the lens, the check that the pieces add up, then the lens's own self-check; with `diff` too,
where inside the blocks the two models part."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from embedlens.reports.lens import (
    BlockSums,
    LensReport,
    LensSummaryReport,
    SiteDiffStats,
    SiteGridRow,
    SiteLayer,
    SiteStats,
)
from embedlens.reports.lens_text import TextSiteLayer, TextSitePairLayer
from embedlens.views.format import Sheet, Words, prob, quoted, shown
from embedlens.views.lens import render_check, runners_up
from embedlens.views.lens_diff import nats

GAINED_SHOWN = 3
"""Tokens a piece raised most that its row shows."""


def row_label(
    row: SiteLayer | SiteGridRow | SiteStats | TextSiteLayer | TextSitePairLayer, num_layers: int
) -> str:
    """`3.attn`, `3.mid`, `3.mlp`, `3`; the embedding and the output named as the lens names
    them."""
    label = row.row or str(row.layer)
    if row.site == "resid" and row.layer == 0:
        return label + " emb"
    if row.site == "resid" and row.layer == num_layers:
        return label + " out"
    return label


def render(r: LensReport) -> RenderableType:
    """The prompt's tokens, the rows, the grid, the blocks' sums and the self-check."""
    assert r.sites is not None
    tokens = Words("tokens: ")
    for i, t in enumerate(r.tokens):
        tokens.token(t.token, style="bold reverse" if i == r.position_index else "").add(" ")
    read = r.tokens[r.position_index].token
    title = Words(f"Logit lens inside the blocks of {r.display_model} after ", style="table.title")
    title.token(read).add(f" (position {r.position_index}, {r.dtype}; sites {', '.join(r.sites)})")
    parts: list[RenderableType] = [tokens, _table(r, title)]
    if r.grid is not None:
        parts.append(_grid(r))
    if r.block_sums is not None:
        parts.append(sums_line(r.block_sums))
    parts.append(render_check(r))
    return Group(*parts)


def _table(r: LensReport, title: Words) -> Sheet:
    table = Sheet(title=title)
    table.add_column("row", justify="right", no_wrap=True)
    table.add_column("read", no_wrap=True)
    table.add_column("top-1", no_wrap=True)
    table.add_column("p", justify="right", no_wrap=True)
    if r.layers and len(r.layers[0].top) > 1:
        table.add_column("next")
    if r.target is not None:
        table.add_column(Words("p(").token(r.target.token).add(")"), justify="right")
        table.add_column("rank", justify="right", no_wrap=True)
    pieces = any(isinstance(row, SiteLayer) and row.change is not None for row in r.layers)
    if pieces:
        table.add_column("change: KL", justify="right", no_wrap=True)
        table.add_column("gained")
    for row in r.layers:
        assert isinstance(row, SiteLayer)
        best = row.top[0]
        cells: list[Text | str] = [row_label(row, r.num_layers), row.decoded, quoted(best.token)]
        cells.append(prob(best.prob, best.logprob))
        if len(row.top) > 1:
            cells.append(runners_up(row.top[1:]))
        if r.target is not None:
            at = row.target
            cells += ["", ""] if at is None else [prob(at.prob, at.logprob), str(at.rank)]
        if pieces:
            cells += _change_cells(row)
        table.add_row(*cells, end_section=row.site == "resid")
    return table


def _change_cells(row: SiteLayer) -> list[Text | str]:
    if row.change is None:
        return ["", ""]
    gained = Words()
    for g in row.change.gained[:GAINED_SHOWN]:
        gained.keep(quoted(g.token).add(f" {g.delta_logprob:+.2f}", style="dim")).add("  ")
    return [f"{row.change.kl:.3g}", gained]


def _grid(r: LensReport) -> Sheet:
    assert r.grid is not None
    grid = Sheet(title="Top-1 at every row (layer and site) and position (columns)")
    grid.add_column("row", justify="right", no_wrap=True)
    for cell in r.grid[0].cells:
        grid.add_column(quoted(r.tokens[cell.position].token), justify="left")
    for row in r.grid:
        label = row_label(row, r.num_layers) if isinstance(row, SiteGridRow) else str(row.layer)
        cells = (
            quoted(c.token).add(f" {prob(c.prob, c.logprob, 2)}", style="dim") for c in row.cells
        )
        grid.add_row(label, *cells)
    return grid


def sums_line(s: BlockSums, reads: bool = True) -> Text:
    """The check that every block's pieces add up (`reads`: and how a piece's rows read)."""
    line = Words().add("✓ ", style="green")
    how = (
        "input + attn_out + mlp_out = output"
        if s.structure == "parallel"
        else "input + attn_out = resid_mid, resid_mid + mlp_out = output"
    )
    reading = (
        " 'direct': the piece alone through the final steps; change: KL(lens after the piece ‖ "
        "before) and the tokens it raised most."
    )
    line.add(
        shown(
            f"pieces add up in every block ({s.structure}: {how}; max |Δ| = "
            f"{s.max_abs_error:.2g} ≤ {s.tolerance:.2g}). attn_out: {s.attn}'s output; "
            f"mlp_out: {s.mlp}'s output." + (reading if reads else "")
        )
    )
    return line


def render_summary(r: LensSummaryReport) -> RenderableType:
    """The statistics per (layer, site), a piece's change KL beside, and the blocks' sums."""
    table = Sheet(title=shown(f"Logit lens inside the blocks of {r.display_model} over "
                              f"{r.n_prompts} prompts ({r.n_positions} positions, {r.dtype})",
                              "table.title"))  # fmt: skip
    targets = r.n_targets > 0
    names = ["KL (nats)", "entropy", "top-1 agrees", "change KL"]
    names += ["p(target)", "log p(target)", "median rank"] if targets else []
    table.add_column("row", justify="right", no_wrap=True)
    for name in names:
        table.add_column(name, justify="right")
    for row in r.layers:
        assert isinstance(row, SiteStats)
        cells = [row_label(row, r.num_layers), f"{row.kl:.3f}", f"{row.entropy:.3f}"]
        cells += [f"{row.top1_agreement:.1%}", _num(row.change_kl, ".3g")]
        if targets:
            cells += [_num(row.target_prob, ".3g"), _num(row.target_logprob, ".3f")]
            cells.append(_num(row.target_rank_median, "g"))
        table.add_row(*cells, end_section=row.site == "resid")
    line = (
        "KL(model's output ‖ row) and the row's entropy in nats; attn_out and mlp_out rows: "
        "the piece decoded directly, and change KL: the mean KL(lens after it ‖ before it)"
    )
    parts: list[RenderableType] = [table, Text(line + ".", style="dim")]
    if r.block_sums is not None:
        parts.append(sums_line(r.block_sums))
    return Group(*parts)


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render_sites_pair(
    r: LensReport | LensSummaryReport, pair: RenderableType, over: str = ""
) -> RenderableType:
    """The pair's tables (`pair`), then its rows inside the blocks and where the two models part
    (`over` many prompts: the means)."""
    assert r.sites is not None and r.site_diff is not None and r.diff is not None
    many = bool(over)
    table = Sheet(title=shown(f"Inside the blocks: {r.display_model} against "
                              f"{r.diff.against}{over} (sites {', '.join(r.sites)})", "table.title"))  # fmt: skip
    kl, top1 = ("mean KL(A ‖ B)", "top-1 agrees") if many else ("KL(A ‖ B)", "top-1")
    for name, justify in (("row", "right"), (kl, "right"), (top1, "right" if many else "left")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for row in r.site_diff:
        label = row.row + (" ←" if row.row == r.parts_at else "")
        if isinstance(row, SiteDiffStats):
            agree = f"{row.top1_agreement:.1%}"
        else:
            agree = "agree" if row.top1_agree else "differ"
        table.add_row(label, nats(row.kl), agree, end_section=row.site == "resid")
    mean = "mean " if many else ""
    if r.parts_in is None:
        line = f"No row inside the blocks parts past {mean}KL {r.diff.threshold:g} nats."
    else:
        where = f"row {r.parts_at}: {r.parts_in}"
        line = f"The two first part at {where} ({mean}KL > {r.diff.threshold:g})."
    parts: list[RenderableType] = [pair, table, Text(line, style="bold")]
    if r.block_sums is not None:
        parts.append(sums_line(r.block_sums))
    return Group(*parts)
