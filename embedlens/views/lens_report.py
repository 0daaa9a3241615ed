"""How the two lens report shapes are shown, each with the parts it holds: one prompt's
(`LensReport`) and the `--prompts` summary's (`LensSummaryReport`: one row per layer of
statistics). Without --against, `lens` shows them (with `sites`, the rows inside the blocks);
with `diff`, A against B is shown here, and with both where inside the blocks the two part.

One prompt against B: each model's top-1 and its probability, whether they agree, KL(A ‖ B)
and the residual KL, the --target's log-probability change; then both self-checks. Many
prompts: the per-layer means. Every figure is shown whole (KL with three significant digits).
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from embedlens.reports import register_view
from embedlens.reports.lens import (
    LensCheck,
    LensDiff,
    LensReport,
    LensSummaryDiff,
    LensSummaryReport,
)
from embedlens.views import lens
from embedlens.views.format import Words, lens_name, shown
from embedlens.views.lens import MARK, sheet, sums_line


def render(r: LensReport) -> RenderableType:
    """One prompt's tables, with its parts'."""
    d = r.diff
    if d is None:
        return lens.render(r)
    head = f"{lens_name(r)} of {r.display_model} (A) against {d.against} (B)"
    names = ["layer", "A top-1", "A p", "B top-1", "B p", "agree", "KL(A‖B)", "residual KL"]
    delta = None
    if r.target is not None:  # the token kept whole: a line never breaks at its leading space
        delta = Words("Δ log p: B's log-probability of ").token(r.target.token).add(" minus A's")
    names += [] if delta is None else ["Δ log p"]
    table = sheet(r, lens.title_after(r, head), names, d.layers)
    states = r.states  # A from a states file: its check said on its own line
    lines: list[RenderableType] = [lens.tokens_line(r), table, _legend(d, "", delta)]
    lines.append(_checks(None if states is not None else r.check, d.against_check))
    if states is not None:
        lines.append(lens.render_check(r))
    if r.tuned is not None:  # both models read through one tuned lens
        lines.append(
            shown(
                f"Both models read through the tuned lens in '{r.tuned.path}' (its translator at "
                f"layers 0-{r.num_layers - 1}), then each model's own decoder.",
                style="dim",
            )
        )
    return _with_sites(r, Group(*lines))


def render_summary(r: LensSummaryReport) -> RenderableType:
    """The summary's tables, with its parts' (A against B: the per-layer means over every
    prompt and position read)."""
    d = r.diff
    if d is None:
        return lens.render_summary(r)
    head = f"{lens_name(r)} of {r.display_model} (A) against {d.against} (B)"
    names = ["layer", "KL(A‖B)", "residual KL", "agrees"]
    delta = None
    if any(row.target_logprob_delta is not None for row in d.layers):
        delta = "Δ log p: B's log-probability of each prompt's target minus A's"
    names += [] if delta is None else ["Δ log p"]
    table = sheet(r, lens.title_over(r, head), names, d.layers)
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
    line = Words().add("✓ " if ok else "✗ NOT FAITHFUL ", style="green" if ok else "bold red")
    mine = "" if a is None else f"{one('A', a)}; "
    return line.add(shown(f"self-check: {mine}{one('B', b)}."))


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


register_view(LensReport, render)
register_view(LensSummaryReport, render_summary)
