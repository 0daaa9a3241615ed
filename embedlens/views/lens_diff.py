"""How `lens --against` is shown: a row per layer of A against B, the first divergent one marked,
and (`--plot`) the curves of KL against layer.

One prompt: each model's top-1 and its probability, whether they agree, KL(A ‖ B) and the
residual KL, the --target's log-probability change; then both self-checks. Many prompts: the
per-layer means. Every figure is shown whole (KL with three significant digits). Both tables
are built by `_table`.

The curves: KL(A ‖ B) and the residual KL, for one prompt or the means over many; the y axis
is linear up to the divergence threshold and logarithmic above it (a KL of exactly 0 stays on
the axis). matplotlib is optional (`pip install 'embedlens[plot]'`) and imported only inside
the functions. PNG and SVG are written by matplotlib; HTML is a page holding the SVG.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

from embedlens.reports.lens import (
    LensCheck,
    LensDiff,
    LensReport,
    LensSummaryDiff,
    LensSummaryReport,
)
from embedlens.views.format import Sheet, Words, lens_name, prob, quoted, shown
from embedlens.views.lens import render_states_check

MARK = " ◀"
"""After the layer label of the first divergent layer."""
Pair = LensReport | LensSummaryReport
"""A lens report with its `diff`."""
Cells = list[Text | str]


def nats(value: float | None) -> str:
    """A KL or a log-probability change, three significant digits ('-' when there is none)."""
    return "-" if value is None else f"{value:.3g}"


def layer_label(layer: int, num_layers: int, first: int | None) -> str:
    """'0 emb', '30 out', a number; the first divergent layer marked."""
    label = {0: f"{layer} emb", num_layers: f"{layer} out"}.get(layer, str(layer))
    return label + (MARK if layer == first else "")


def render(r: LensReport) -> RenderableType:
    """The prompt's tokens, the table of A against B, and both self-checks."""
    d = r.diff
    assert d is not None
    tokens = Words("tokens: ")
    for i, t in enumerate(r.tokens):
        tokens.token(t.token, style="bold reverse" if i == r.position_index else "").add(" ")
    read = r.tokens[r.position_index].token
    title = Words(
        f"{lens_name(r)} of {r.display_model} (A) against {d.against} (B) after ",
        style="table.title",
    ).token(read)
    title.add(f" (position {r.position_index}, {r.dtype})")
    rows = []
    for mine, theirs in zip(r.layers, d.layers, strict=True):
        a, b = mine.top[0], theirs.against_top[0]
        cells: Cells = [quoted(a.token), prob(a.prob, a.logprob), quoted(b.token)]
        cells += [prob(b.prob, b.logprob), "yes" if theirs.top1_agree else "NO"]
        rows.append((mine.layer, [*cells, nats(theirs.kl), nats(theirs.residual_kl)]))
    columns = [("A top-1", False), ("p", True), ("B top-1", False), ("p", True)]
    columns += [("agree", False), ("KL(A‖B)", True), ("residual KL", True)]
    delta = None
    if r.target is not None:  # the token kept whole: a line never breaks at its leading space
        said = Words("Δ log p: B's log-probability of ").token(r.target.token).add(" minus A's")
        delta = said, [row.target_logprob_delta for row in d.layers]
    states = r.states  # A from a states file: its check said on its own line
    lines = _table(r, title, columns, rows, delta)
    lines.append(_checks(None if states is not None else r.check, d.against_check))
    if states is not None:
        lines.append(render_states_check(r, states))
    if r.tuned is not None:  # both models read through one tuned lens
        lines.append(
            shown(
                f"Both models read through the tuned lens in '{r.tuned.path}' (its translator at "
                f"layers 0-{r.num_layers - 1}), then each model's own decoder.",
                style="dim",
            )
        )
    return Group(tokens, *lines)


def render_summary(r: LensSummaryReport) -> RenderableType:
    """The per-layer means of A against B over every prompt and position read."""
    d = r.diff
    assert d is not None
    title = (
        f"{lens_name(r)} of {r.display_model} (A) against {d.against} (B) over {r.n_prompts} "
        f"prompts ({r.n_positions} positions, {r.dtype})"
    )
    rows: list[tuple[int, Cells]] = [
        (row.layer, [nats(row.kl), nats(row.residual_kl), f"{row.top1_agreement:.1%}"])
        for row in d.layers
    ]
    columns = [("KL(A‖B)", True), ("residual KL", True), ("top-1 agrees", True)]
    delta = None
    if any(row.target_logprob_delta is not None for row in d.layers):
        said = "Δ log p: B's log-probability of each prompt's target minus A's"
        delta = said, [row.target_logprob_delta for row in d.layers]
    parts = _table(r, shown(title, "table.title"), columns, rows, delta, "mean ")
    if d.n_against_unfaithful:
        parts.append(
            Text(
                f"✗ B's lens does not reproduce its own logits on {d.n_against_unfaithful} "
                "prompts: its rows there are not faithful",
                style="bold red",
            )
        )
    return Group(*parts)


def _table(
    r: Pair,
    title: Text,
    columns: Sequence[tuple[str, bool]],
    rows: Sequence[tuple[int, Cells]],
    delta: tuple[str | Words, Sequence[float | None]] | None,
    mean: str = "",
) -> list[RenderableType]:
    """The table of A against B, a row per layer (`rows`: the layer and its cells after its
    label; `columns`: their names, and whether each is aligned right), the --target's change
    last with `delta` (what the legend says of it, and each row's); and its legend."""
    d = r.diff
    assert d is not None
    if delta is not None:
        columns = [*columns, ("Δ log p", True)]
        rows = [(x, [*cells, nats(v)]) for (x, cells), v in zip(rows, delta[1], strict=True)]
    table = Sheet(title=title)
    for name, right in (("layer", True), *columns):
        table.add_column(name, justify="right" if right else "left", no_wrap=True)
    for layer, cells in rows:
        label = layer_label(layer, r.num_layers, d.first_divergent_layer)
        table.add_row(label, *cells, end_section=layer == r.num_layers - 1)
    return [table, _legend(d, mean, None if delta is None else delta[0])]


def _legend(d: LensDiff | LensSummaryDiff, mean: str, delta: str | Words | None) -> Text:
    """What the columns mean, and where the two models part (among every layer, shown or not)."""
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
    line = Words().add("✓ " if ok else "✗ NOT FAITHFUL ", style="green" if ok else "bold red")
    mine = "" if a is None else f"{one('A', a)}; "
    return line.add(shown(f"self-check: {mine}{one('B', b)}."))


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
    from embedlens.views.curves import save_figure

    save_figure(lambda: figure(report), _title(report), path)
