"""How the two `lens` report shapes are shown: one prompt's (`LensReport`) and the `--prompts`
summary's (`LensSummaryReport`), each with the parts it holds.

Every column of every lens table is declared once in `COLUMNS` (its name, header, how a row's
cell is read and written, its alignment); a table is a list of their names, built by `sheet`.
One prompt (`render`): the prompt's tokens, a row per layer (with --site a row per (layer,
site), what each piece does to the lens), the grid, the blocks' sums and the self-check. Many
prompts (`render_summary`): a row per layer (or (layer, site)) of statistics. With --against
(`_pair`, `_pair_summary`): each model's top-1, whether they agree, KL(A ‖ B) and the residual
KL, the --target's log-probability change (over many prompts, the per-layer means), both
self-checks, and with --site where inside the blocks the two part.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rich.console import Group, RenderableType
from rich.text import Text

from embedlens.reports import register_view
from embedlens.reports.lens import (
    BlockSums,
    LensCheck,
    LensDiff,
    LensReport,
    LensSummaryDiff,
    LensSummaryReport,
    Prediction,
    SiteChange,
    SiteGridRow,
    SiteLayer,
    SiteStats,
    TargetAt,
)
from embedlens.reports.lens_text import TextSiteLayer, TextSitePairLayer
from embedlens.views.format import Sheet, Words, learned_note, lens_name, prob, quoted, shown

NEXT_SHOWN = 100
"""Predictions after the top-1 that a table row shows; the rest are counted."""
GAINED_SHOWN = 3
"""Tokens a piece raised most that its row shows."""
MARK = " ◀"
"""After the layer label of the first divergent layer."""


@dataclass(frozen=True)
class Column:
    """One column of the lens's tables: its header (or how the report gives it), how a row's
    value is read (`read`: the row's attribute of that name, or a function of the report and
    the row) and written (`show`), its alignment, and whether its cells may wrap (None: as the
    table says)."""

    name: str
    header: str | Callable[[Any], Text]
    read: str | Callable[[Any, Any], Any]
    show: Callable[[Any], Text | str] = str
    justify: Literal["left", "right"] = "right"
    no_wrap: bool | None = None

    def cell(self, r: Any, row: Any) -> Text | str:
        """The cell of `row` (of the report `r`)."""
        value = getattr(row, self.read) if isinstance(self.read, str) else self.read(r, row)
        return self.show(value)


def _spec(spec: str) -> Callable[[float | None], str]:
    """A figure written with the format `spec` ('-' when there is none)."""
    return lambda value: "-" if value is None else format(value, spec)


def _target(r: LensReport) -> Words:
    assert r.target is not None
    return Words("p(").token(r.target.token).add(")")


def _p(pred: Prediction | TargetAt) -> str:
    return prob(pred.prob, pred.logprob)


def _layer(r: LensReport | LensSummaryReport, row: Any) -> str:
    first = None if r.diff is None else r.diff.first_divergent_layer
    return layer_label(row.layer, r.num_layers, first)


def _a_top(r: LensReport, row: Any) -> Prediction:
    """A's top-1 at the layer of B's `row` (A's rows are the report's `layers`)."""
    return next(mine.top[0] for mine in r.layers if mine.layer == row.layer)


def _logit(r: LensSummaryReport, row: Any) -> Any:
    """The logit lens's statistics at the row's layer (--compare-logit)."""
    return next(x for x in r.logit_layers or [] if x.layer == row.layer)


def _or_blank(show: Callable[[Any], str]) -> Callable[[Any], str]:
    """`show`, or an empty cell where there is no value (a row without the --target)."""
    return lambda value: "" if value is None else show(value)


def _says(yes: str, no: str) -> Callable[[bool], str]:
    return lambda agree: yes if agree else no


def _gained(change: SiteChange | None) -> Words:
    gained = Words()
    for g in [] if change is None else change.gained[:GAINED_SHOWN]:
        gained.keep(quoted(g.token).add(f" {g.delta_logprob:+.2f}", style="dim")).add("  ")
    return gained


def layer_label(layer: int, num_layers: int, first: int | None = None) -> str:
    """'0 emb', '30 out', a number; the first divergent layer marked."""
    label = {0: f"{layer} emb", num_layers: f"{layer} out"}.get(layer, str(layer))
    return label + (MARK if layer == first else "")


def row_label(
    row: SiteLayer | SiteGridRow | SiteStats | TextSiteLayer | TextSitePairLayer, num_layers: int
) -> str:
    """`3.attn`, `3.mid`, `3.mlp`, `3`; the embedding and the output named as the lens names
    them."""
    end = {0: " emb", num_layers: " out"}.get(row.layer, "") if row.site == "resid" else ""
    return (row.row or str(row.layer)) + end


def runners_up(top: Sequence[Prediction]) -> Words:
    """The next predictions after the top-1, at most NEXT_SHOWN of them, then how many more
    there are: -k 49152 would fill a terminal with a table no one reads (and take minutes to
    lay out); `--json` lists them all. A line breaks between predictions, never inside one
    (a token and its probability stay together)."""
    rest = Words()
    for pred in top[:NEXT_SHOWN]:
        p_text = prob(pred.prob, pred.logprob)
        rest.keep(quoted(pred.token).add(f" {p_text}", style="dim")).add("  ")
    if len(top) > NEXT_SHOWN:
        rest.append(f"and {len(top) - NEXT_SHOWN:,} more (--json lists them all)", style="dim")
    return rest


_FIXED, _RATE, _SHORT = _spec(".3f"), _spec(".1%"), _spec("g")
nats = _spec(".3g")
"""A KL or a log-probability change, three significant digits ('-' when there is none)."""

COLUMNS = {
    c.name: c
    for c in (
        # the rows' labels: a layer (the first divergent one marked), or a row inside the blocks
        Column("layer", "layer", _layer, no_wrap=True),
        Column("row", "row", lambda r, row: row_label(row, r.num_layers), no_wrap=True),
        Column("read", "read", "decoded", justify="left"),
        # one prompt: the lens's predictions, the --target's, and what a piece does to the lens
        Column("top-1", "top-1", lambda r, row: row.top[0].token, quoted, "left"),
        Column("p", "p", lambda r, row: row.top[0], _p),
        Column("next", "next", lambda r, row: row.top[1:], runners_up, "left", no_wrap=False),
        Column("p(target)", _target, "target", _or_blank(_p), no_wrap=False),
        Column("rank", "rank", "target", _or_blank(lambda t: str(t.rank))),
        Column("change", "change: KL", "change", _or_blank(lambda c: nats(c.kl))),
        Column("gained", "gained", "change", _gained, "left", no_wrap=False),
        # many prompts: each layer's statistics
        Column("kl", "KL (nats)", "kl", _FIXED),
        Column("entropy", "entropy", "entropy", _FIXED),
        Column("agrees", "top-1 agrees", "top1_agreement", _RATE),
        Column("logit kl", "logit KL", lambda r, row: _logit(r, row).kl, _FIXED),
        Column("logit top-1", "logit top-1", lambda r, row: _logit(r, row).top1_agreement, _RATE),
        Column("change kl", "change KL", "change_kl", nats),
        Column("mean p", "p(target)", "target_prob", nats),
        Column("mean log p", "log p(target)", "target_logprob", _FIXED),
        Column("median rank", "median rank", "target_rank_median", _SHORT),
        Column("next rank", "next rank", "next_rank_median", _SHORT),
        # A against B: A's rows are the report's, B's and the comparison the diff's
        Column("A top-1", "A top-1", lambda r, row: _a_top(r, row).token, quoted, "left"),
        Column("A p", "p", _a_top, _p),
        Column("B top-1", "B top-1", lambda r, row: row.against_top[0].token, quoted, "left"),
        Column("B p", "p", lambda r, row: row.against_top[0], _p),
        Column("agree", "agree", "top1_agree", _says("yes", "NO"), "left"),
        Column("KL(A‖B)", "KL(A‖B)", "kl", nats),
        Column("residual KL", "residual KL", "residual_kl", nats),
        Column("Δ log p", "Δ log p", "target_logprob_delta", nats),
        # A against B inside the blocks: the row where the two first part marked
        Column("site row", "row", lambda r, row: row.row + (" ←" if row.row == r.parts_at else "")),
        Column("site KL", "KL(A ‖ B)", "kl", nats),
        Column("site mean KL", "mean KL(A ‖ B)", "kl", nats),
        Column("site top-1", "top-1", "top1_agree", _says("agree", "differ"), "left"),
    )
}
"""Every column of the lens's tables, by name."""


def sheet(
    r: Any, title: Text, names: Sequence[str], rows: Sequence[Any], no_wrap: bool = True
) -> Sheet:
    """The table of `rows` with the columns `names` (whose cells do not wrap unless `no_wrap`
    is False or the column says otherwise); a section ends after the last block's row (with
    sites, after each layer's resid row)."""
    table = Sheet(title=title)
    columns = [COLUMNS[name] for name in names]
    for c in columns:
        header = c.header if isinstance(c.header, str) else c.header(r)
        wraps = no_wrap if c.no_wrap is None else c.no_wrap
        table.add_column(header, justify=c.justify, no_wrap=wraps)
    for row in rows:
        end = row.site == "resid" if hasattr(row, "site") else row.layer == r.num_layers - 1
        table.add_row(*(c.cell(r, row) for c in columns), end_section=end)
    return table


def tokens_line(r: LensReport) -> Words:
    """The prompt's tokens, the one read highlighted."""
    tokens = Words("tokens: ")
    for i, t in enumerate(r.tokens):
        tokens.token(t.token, style="bold reverse" if i == r.position_index else "").add(" ")
    return tokens


def title_after(r: LensReport, head: str, tail: str = "") -> Words:
    """A one-prompt table's title: `head`, then the token read, its position and the dtype."""
    title = Words(f"{head} after ", style="table.title").token(r.tokens[r.position_index].token)
    return title.add(f" (position {r.position_index}, {r.dtype}{tail})")


def title_over(r: LensSummaryReport, head: str) -> Words:
    """A summary table's title: `head`, then what it was taken over."""
    over = f" over {r.n_prompts} prompts ({r.n_positions} positions, {r.dtype})"
    return shown(head + over, "table.title")


def _head(r: LensReport | LensSummaryReport) -> str:
    """A table's head: which lens read which model (against which B, or inside the blocks)."""
    if r.diff is None and r.sites is not None:
        return f"Logit lens inside the blocks of {r.display_model}"
    head = f"{lens_name(r)} of {r.display_model}"
    return head if r.diff is None else f"{head} (A) against {r.diff.against} (B)"


def render(r: LensReport) -> RenderableType:
    """The prompt's tokens, one row per layer (with --site per (layer, site)), the grid, the
    blocks' sums and the self-check; with --against, A against B (`_pair`)."""
    if r.diff is not None:
        return _pair(r, r.diff)
    names = ["row", "read"] if r.sites is not None else ["layer"]
    names += ["top-1", "p"]
    names += ["next"] if r.layers and len(r.layers[0].top) > 1 else []
    names += ["p(target)", "rank"] if r.target is not None else []
    if any(isinstance(row, SiteLayer) and row.change is not None for row in r.layers):
        names += ["change", "gained"]
    title = title_after(r, _head(r), "" if r.sites is None else f"; sites {', '.join(r.sites)}")
    parts: list[RenderableType] = [tokens_line(r), sheet(r, title, names, r.layers)]
    if r.grid is not None:
        parts.append(_grid(r))
    if r.block_sums is not None:
        parts.append(sums_line(r.block_sums))
    parts.append(render_check(r))
    note = learned_note(r)
    if note is not None:
        parts.append(shown(note, style="dim"))
    return Group(*parts)


def _grid(r: LensReport) -> Sheet:
    assert r.grid is not None
    rows = "layer (rows)" if r.sites is None else "row (layer and site)"
    grid = Sheet(title=f"Top-1 at every {rows} and position (columns)")
    grid.add_column("layer" if r.sites is None else "row", justify="right", no_wrap=True)
    for cell in r.grid[0].cells:
        grid.add_column(quoted(r.tokens[cell.position].token), justify="left")
    for row in r.grid:
        label = row_label(row, r.num_layers) if isinstance(row, SiteGridRow) else str(row.layer)
        cells = (
            quoted(c.token).add(f" {prob(c.prob, c.logprob, 2)}", style="dim") for c in row.cells
        )
        grid.add_row(label, *cells)
    return grid


def render_summary(r: LensSummaryReport) -> RenderableType:
    """The per-layer statistics (with --site per (layer, site), a piece's change KL beside),
    a line saying what they were taken over, and the blocks' sums; with --against, A against B
    (`_pair_summary`)."""
    if r.diff is not None:
        return _pair_summary(r, r.diff)
    sites = r.sites is not None
    names = ["row", "kl", "entropy", "agrees", "change kl"] if sites else ["layer"]
    names += [] if sites else ["kl", "entropy", "agrees"]
    if r.logit_layers:  # --compare-logit: the logit lens beside the tuned lens
        names += ["logit kl", "logit top-1"]
    targets = r.n_targets > 0
    names += ["mean p", "mean log p", "median rank"] if targets else []
    # with targets, the rank shown is the target's ("median rank"); without, the next token's
    ranked = not targets and not sites
    ranked = ranked and any(row.next_rank_median is not None for row in r.layers)
    names += ["next rank"] if ranked else []
    if sites:
        line = (
            "KL(model's output ‖ row) and the row's entropy in nats; attn_out and mlp_out rows: "
            "the piece decoded directly, and change KL: the mean KL(lens after it ‖ before it)"
        )
    else:
        line = _summary_line(r, targets, ranked)
    # Headers wrap at their spaces on a narrow terminal; the figures never do.
    table = sheet(r, title_over(r, _head(r)), names, r.layers, no_wrap=False)
    parts: list[RenderableType] = [table]
    parts.append(Text(line + ".", style="dim"))
    if r.block_sums is not None:
        parts.append(sums_line(r.block_sums))
    return Group(*parts)


def _summary_line(r: LensSummaryReport, targets: bool, ranked: bool) -> str:
    """What the summary's statistics are, and what they were taken over."""
    where = {-1: "the last position"}.get(r.position) if isinstance(r.position, int) else None
    if where is None:
        at = ",".join(str(p) for p in r.position) if isinstance(r.position, list) else r.position
        where = "every position" if r.position == "all" else f"positions {at}"
    line = f"KL(model's output ‖ lens) and the lens's entropy in nats, at {where} of each prompt"
    if targets:
        line += f"; target statistics over the {r.n_targets} prompts with a target"
    if ranked:
        line += "; next rank: the median rank by logit of the token after each position read"
    if r.logit_layers:
        line += "; logit KL and logit top-1: the logit lens on the same prompts"
    if r.n_skipped:
        line += f"; {r.n_skipped} bad lines skipped"
    return line


def _pair(r: LensReport, d: LensDiff) -> RenderableType:
    """One prompt, A against B: the table, what it says, both self-checks."""
    names = ["layer", "A top-1", "A p", "B top-1", "B p", "agree", "KL(A‖B)", "residual KL"]
    delta = None
    if r.target is not None:  # the token kept whole: a line never breaks at its leading space
        delta = Words("Δ log p: B's log-probability of ").token(r.target.token).add(" minus A's")
    names += [] if delta is None else ["Δ log p"]
    table = sheet(r, title_after(r, _head(r)), names, d.layers)
    states = r.states  # A from a states file: its check said on its own line
    lines: list[RenderableType] = [tokens_line(r), table, _legend(d, "", delta)]
    lines.append(_checks(None if states is not None else r.check, d.against_check))
    if states is not None:
        lines.append(render_check(r))
    note = learned_note(r, both=True)  # both models read through one learned lens
    if note is not None:
        lines.append(shown(note, style="dim"))
    return _with_sites(r, Group(*lines))


def _pair_summary(r: LensSummaryReport, d: LensSummaryDiff) -> RenderableType:
    """Many prompts, A against B: the per-layer means over every prompt and position read."""
    names = ["layer", "KL(A‖B)", "residual KL", "agrees"]
    delta = None
    if any(row.target_logprob_delta is not None for row in d.layers):
        delta = "Δ log p: B's log-probability of each prompt's target minus A's"
    names += [] if delta is None else ["Δ log p"]
    table = sheet(r, title_over(r, _head(r)), names, d.layers)
    parts: list[RenderableType] = [table, _legend(d, "mean ", delta)]
    if d.n_against_unfaithful:
        parts.append(
            Text(
                f"✗ B's lens does not reproduce its own logits on {d.n_against_unfaithful} "
                "prompts: its rows there are not faithful",
                style="bold red",
            )
        )
    return _with_sites(r, Group(*parts), f" over {r.n_prompts} prompts")


def _legend(d: LensDiff | LensSummaryDiff, mean: str, delta: str | Words | None) -> Text:
    """What the columns mean (`delta`: what it says of the --target's change, if shown), and
    where the two models part (among every layer, shown or not)."""
    first, threshold = d.first_divergent_layer, d.threshold
    if first is None:
        where = f"No layer diverges ({mean}KL ≤ {threshold:.3g} nats at every layer)"
    elif first in {row.layer for row in d.layers}:
        where = f"First divergent layer: {first}{MARK} ({mean}KL > {threshold:.3g} nats)"
    else:
        where = (
            f"First divergent layer: {first} ({mean}KL > {threshold:.3g} nats), not among the "
            "layers shown"
        )
    line = shown(
        "KL in nats, each model's lens through its own decoder; residual KL: A's decoder on "
        "B's residual stream (0 where the two streams are equal)",
        style="dim",
    )
    if delta is not None:
        line.add("; ").add(delta)
    return line.add(f". {where}.")


def _checks(a: LensCheck | None, b: LensCheck) -> Text:
    """Both self-checks on one line (B's alone without A's)."""

    def one(name: str, c: LensCheck) -> str:
        sign = "≤" if c.ok else ">"
        verdict = (
            "reproduces its logits" if c.ok else f"does NOT reproduce its logits ({c.suspect})"
        )
        return f"{name} {verdict} (max |Δ| = {c.max_abs_logit_diff:.2g} {sign} {c.tolerance:.0e})"

    ok = (a is None or a.ok) and b.ok
    mine = "" if a is None else f"{one('A', a)}; "
    return _verdict("✓ " if ok else "✗ NOT FAITHFUL ", f"self-check: {mine}{one('B', b)}.")


def _with_sites(
    r: LensReport | LensSummaryReport, pair: RenderableType, over: str = ""
) -> RenderableType:
    """The pair's tables (`pair`), then (with --site) its rows inside the blocks and where the
    two models part (`over` many prompts: the means)."""
    if r.sites is None:
        return pair
    assert r.site_diff is not None and r.diff is not None
    title = f"Inside the blocks: {r.display_model} against {r.diff.against}{over}"
    title += f" (sites {', '.join(r.sites)})"
    names = (
        ["site row", "site mean KL", "agrees"] if over else ["site row", "site KL", "site top-1"]
    )
    table = sheet(r, shown(title, "table.title"), names, r.site_diff)
    mean = "mean " if over else ""
    if r.parts_in is None:
        line = f"No row inside the blocks parts past {mean}KL {r.diff.threshold:g} nats."
    else:
        where = f"row {r.parts_at}: {r.parts_in}"
        line = f"The two first part at {where} ({mean}KL > {r.diff.threshold:g})."
    parts: list[RenderableType] = [pair, table, Text(line, style="bold")]
    if r.block_sums is not None:
        parts.append(sums_line(r.block_sums))
    return Group(*parts)


def sums_line(s: BlockSums, reads: bool = True) -> Text:
    """The check that every block's pieces add up (`reads`: and how a piece's rows read)."""
    how = (
        "input + attn_out + mlp_out = output"
        if s.structure == "parallel"
        else "input + attn_out = resid_mid, resid_mid + mlp_out = output"
    )
    reading = (
        " 'direct': the piece alone through the final steps; change: KL(lens after the piece ‖ "
        "before) and the tokens it raised most."
    )
    return _verdict(
        "✓ ",
        f"pieces add up in every block ({s.structure}: {how}; max |Δ| = "
        f"{s.max_abs_error:.2g} ≤ {s.tolerance:.2g}). attn_out: {s.attn}'s output; "
        f"mlp_out: {s.mlp}'s output." + (reading if reads else ""),
    )


def render_check(r: LensReport) -> Text:
    """The self-check line: whether decoding the last block's output reproduces the model's
    logits, and the decode's steps (with --states: the file's check, the file and what was read
    of the model)."""
    c, states = r.check, r.states
    steps = " → ".join(["block " + str(r.num_layers), *r.steps])
    if states is None and c.ok:
        return _verdict(
            "✓ ",
            f"self-check: decoding block {r.num_layers}'s output reproduces the model's "
            f"logits (max |Δ| = {c.max_abs_logit_diff:.2g} ≤ {c.tolerance:.0e}). "
            f"Decode: {steps}.",
        )
    miss = f"self-check: max |Δ| = {c.max_abs_logit_diff:.3g} > {c.tolerance:.0e}"
    if states is None:
        return _verdict("✗ NOT FAITHFUL ", f"{miss}; suspect: {c.suspect}. Decode: {steps}.")
    held = ", ".join(str(layer) for layer in states.layers)
    read = ", ".join(states.tensors_read) or "nothing"
    where = (
        f"States: '{states.file}' ({states.layout}'s layout, {states.dtype}, layers {held}); "
        f"read of the model: {read}. Decode: {steps}."
    )
    if not states.checked:  # why no check was made
        return _verdict("? ", f"self-check {states.check}. {where}")
    if c.ok:
        return _verdict("✓ ", f"self-check {states.check}. {where}")
    return _verdict("✗ NOT FAITHFUL ", f"{miss}. {where}")


def _verdict(mark: str, text: str) -> Text:
    """A self-check line: its mark (✓, ✗ NOT FAITHFUL or ?) in its colour, then the text."""
    style = {"✓": "green", "✗": "bold red"}.get(mark[0], "yellow")
    return Words().add(mark, style=style).add(shown(text))


register_view(LensReport, render)
register_view(LensSummaryReport, render_summary)
