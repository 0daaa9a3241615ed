"""How `lens --against` is shown: a row per layer of A against B, the first divergent one marked.

One prompt: each model's top-1 and its probability, whether they agree, KL(A ‖ B) and the
residual KL, the --target's log-probability change; then both self-checks. Many prompts: the
per-layer means. Every figure is shown whole (KL with three significant digits).
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from embedlens.reports.lens import LensCheck, LensReport, LensSummaryReport
from embedlens.views.format import Sheet, Words, lens_name, prob, quoted, shown
from embedlens.views.lens import render_states_check

MARK = " ◀"
"""After the layer label of the first divergent layer."""


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
    table = Sheet(title=title)
    for name, right in (
        ("layer", True),
        ("A top-1", False),
        ("p", True),
        ("B top-1", False),
        ("p", True),
        ("agree", False),
        ("KL(A‖B)", True),
        ("residual KL", True),
    ):
        table.add_column(name, justify="right" if right else "left", no_wrap=True)  # fmt: skip
    if r.target is not None:
        table.add_column("Δ log p", justify="right", no_wrap=True)
    for mine, theirs in zip(r.layers, d.layers, strict=True):
        a, b = mine.top[0], theirs.against_top[0]
        cells: list[Text | str] = [
            layer_label(mine.layer, r.num_layers, d.first_divergent_layer),
            quoted(a.token),
            prob(a.prob, a.logprob),
            quoted(b.token),
            prob(b.prob, b.logprob),
            "yes" if theirs.top1_agree else "NO",
            nats(theirs.kl),
            nats(theirs.residual_kl),
        ]
        if r.target is not None:
            cells.append(nats(theirs.target_logprob_delta))
        table.add_row(*cells, end_section=mine.layer == r.num_layers - 1)
    delta = None
    if r.target is not None:  # the token kept whole: a line never breaks at its leading space
        delta = Words("Δ log p: B's log-probability of ").token(r.target.token).add(" minus A's")
    shown_layers = {row.layer for row in r.layers}
    legend = _legend(d.first_divergent_layer, d.threshold, delta=delta, shown_layers=shown_layers)
    states = r.states  # A from a states file: its check said on its own line
    lines = [legend, _checks(None if states is not None else r.check, d.against_check)]
    if states is not None:
        lines.append(render_states_check(r, states))
    if r.tuned is not None:
        lines.append(_through_tuned(r.tuned.path, r.num_layers))
    return Group(tokens, table, *lines)


def _through_tuned(path: str, num_layers: int) -> Words:
    """The line that says both models were read through one tuned lens."""
    return shown(
        f"Both models read through the tuned lens in '{path}' (its translator at layers "
        f"0-{num_layers - 1}), then each model's own decoder.",
        style="dim",
    )


def render_summary(r: LensSummaryReport) -> RenderableType:
    """The per-layer means of A against B over every prompt and position read."""
    d = r.diff
    assert d is not None
    title = (
        f"{lens_name(r)} of {r.display_model} (A) against {d.against} (B) over {r.n_prompts} "
        f"prompts ({r.n_positions} positions, {r.dtype})"
    )
    table = Sheet(title=shown(title, "table.title"))
    for name in ("layer", "KL(A‖B)", "residual KL", "top-1 agrees"):
        table.add_column(name, justify="right", no_wrap=True)
    targets = any(row.target_logprob_delta is not None for row in d.layers)
    if targets:
        table.add_column("Δ log p", justify="right", no_wrap=True)
    for row in d.layers:
        cells = [
            layer_label(row.layer, r.num_layers, d.first_divergent_layer),
            nats(row.kl),
            nats(row.residual_kl),
            f"{row.top1_agreement:.1%}",
        ]
        if targets:
            cells.append(nats(row.target_logprob_delta))
        table.add_row(*cells, end_section=row.layer == r.num_layers - 1)
    delta = "Δ log p: B's log-probability of each prompt's target minus A's" if targets else None
    shown_layers = {row.layer for row in d.layers}
    legend = _legend(d.first_divergent_layer, d.threshold, "mean ", delta, shown_layers)
    parts: list[RenderableType] = [table, legend]
    if d.n_against_unfaithful:
        parts.append(
            Text(
                f"✗ B's lens does not reproduce its own logits on {d.n_against_unfaithful} "
                "prompts: its rows there are not faithful",
                style="bold red",
            )
        )
    return Group(*parts)


def _legend(
    first: int | None,
    threshold: float,
    mean: str = "",
    delta: str | Words | None = None,
    shown_layers: set[int] | None = None,
) -> Text:
    """What the columns mean, and where the two models part (among every layer, shown or not)."""
    hidden = first is not None and shown_layers is not None and first not in shown_layers
    where = (
        f"First divergent layer: {first}{MARK} ({mean}KL > {threshold:.3g} nats)"
        if first is not None and not hidden
        else f"First divergent layer: {first} ({mean}KL > {threshold:.3g} nats), not among the "
        "layers shown"
        if hidden
        else f"No layer diverges ({mean}KL ≤ {threshold:.3g} nats at every layer)"
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
