"""How the `lens` report is shown without its optional parts: the prompt's tokens, a row per
layer, the grid and the self-check (`lens_report` adds the parts' tables)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Group, RenderableType
from rich.text import Text

from embedlens.reports.lens import LensReport, Prediction, StatesSource
from embedlens.views.format import Sheet, Words, lens_name, prob, quoted, shown

NEXT_SHOWN = 100
"""Predictions after the top-1 that a table row shows; the rest are counted."""


def render(r: LensReport) -> RenderableType:
    """The prompt's tokens, one row per layer, the grid, and the self-check."""
    parts: list[RenderableType] = []
    tokens = Words("tokens: ")
    for i, t in enumerate(r.tokens):
        tokens.token(t.token, style="bold reverse" if i == r.position_index else "").add(" ")
    parts.append(tokens)
    read = r.tokens[r.position_index].token
    title = Words(f"{lens_name(r)} of {r.display_model} after ", style="table.title").token(read)
    title.add(f" (position {r.position_index}, {r.dtype})")
    table = Sheet(title=title)
    table.add_column("layer", justify="right", no_wrap=True)
    table.add_column("top-1", no_wrap=True)
    table.add_column("p", justify="right", no_wrap=True)
    if r.layers and len(r.layers[0].top) > 1:
        table.add_column("next")
    if r.target is not None:
        table.add_column(Words("p(").token(r.target.token).add(")"), justify="right")
        table.add_column("rank", justify="right", no_wrap=True)
    for row in r.layers:
        label = str(row.layer)
        if row.layer == 0:
            label += " emb"
        elif row.layer == r.num_layers:
            label += " out"
        best = row.top[0]
        cells: list[Text | str] = [label, quoted(best.token), prob(best.prob, best.logprob)]
        if len(row.top) > 1:
            cells.append(runners_up(row.top[1:]))
        if r.target is not None and row.target is not None:
            cells += [prob(row.target.prob, row.target.logprob), str(row.target.rank)]
        table.add_row(*cells, end_section=row.layer == r.num_layers - 1)
    parts.append(table)
    if r.grid is not None:
        parts.append(_render_grid(r))
    parts.append(render_check(r))
    tuned = r.tuned
    if tuned is not None:
        parts.append(
            shown(
                f"Layers 0-{r.num_layers - 1} are read through the tuned lens in '{tuned.path}' "
                f"(made by {tuned.made_by}): its translator, then the same decode; layer "
                f"{r.num_layers} is the model's own output.",
                style="dim",
            )
        )
    return Group(*parts)


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


def _render_grid(r: LensReport) -> Sheet:
    assert r.grid is not None
    grid = Sheet(title="Top-1 at every layer (rows) and position (columns)")
    grid.add_column("layer", justify="right", no_wrap=True)
    for cell in r.grid[0].cells:
        grid.add_column(quoted(r.tokens[cell.position].token), justify="left")
    for row in r.grid:
        grid.add_row(
            str(row.layer),
            *(
                quoted(c.token).add(f" {prob(c.prob, c.logprob, 2)}", style="dim")
                for c in row.cells
            ),
        )
    return grid


def render_check(r: LensReport) -> Text:
    """The self-check line: whether decoding the last block's output reproduces the model's
    logits, and the decode's steps (with --states: the file's check, `render_states_check`)."""
    states = r.states
    if states is not None:  # lens --states: the check against the file, or why none was made
        return render_states_check(r, states)
    c = r.check
    steps = " → ".join(["block " + str(r.num_layers), *r.steps])
    if c.ok:
        return _verdict(
            "✓ ",
            f"self-check: decoding block {r.num_layers}'s output reproduces the model's "
            f"logits (max |Δ| = {c.max_abs_logit_diff:.2g} ≤ {c.tolerance:.0e}). "
            f"Decode: {steps}.",
        )
    return _verdict(
        "✗ NOT FAITHFUL ",
        f"self-check: max |Δ| = {c.max_abs_logit_diff:.3g} > {c.tolerance:.0e}; "
        f"suspect: {c.suspect}. Decode: {steps}.",
    )


def render_states_check(r: LensReport, states: StatesSource) -> Text:
    """The self-check line of a states report, with the file and what was read of the model."""
    steps = " → ".join(["block " + str(r.num_layers), *r.steps])
    held = ", ".join(str(layer) for layer in states.layers)
    read = ", ".join(states.tensors_read) or "nothing"
    where = (
        f"States: '{states.file}' ({states.layout}'s layout, {states.dtype}, layers {held}); "
        f"read of the model: {read}. Decode: {steps}."
    )
    c = r.check
    if not states.checked:
        return _verdict("? ", f"self-check {states.check}. {where}")
    if c.ok:
        return _verdict("✓ ", f"self-check {states.check}. {where}")
    return _verdict(
        "✗ NOT FAITHFUL ",
        f"self-check: max |Δ| = {c.max_abs_logit_diff:.3g} > {c.tolerance:.0e}. {where}",
    )


def _verdict(mark: str, text: str) -> Text:
    """A self-check line: its mark (✓, ✗ NOT FAITHFUL or ?) in its colour, then the text."""
    style = {"✓": "green", "✗": "bold red"}.get(mark[0], "yellow")
    return Words().add(mark, style=style).add(shown(text))
