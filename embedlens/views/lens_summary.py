"""How the `lens --prompts` summary is shown: one row per layer of statistics over the prompts."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from embedlens.reports import register_view
from embedlens.reports.lens import LensSummaryReport
from embedlens.views.format import Sheet, shown


def render(r: LensSummaryReport) -> RenderableType:
    """The per-layer table, and a line saying what it was taken over."""
    where = {-1: "the last position"}.get(r.position) if isinstance(r.position, int) else None
    if where is None:
        where = "every position" if r.position == "all" else f"positions {_positions(r.position)}"
    title = (
        f"Logit lens of {r.display_model} over {r.n_prompts} prompts "
        f"({r.n_positions} positions, {r.dtype})"
    )
    table = Sheet(title=shown(title, "table.title"))
    # Headers wrap at their spaces on a narrow terminal; the figures never do.
    table.add_column("layer", justify="right", no_wrap=True)
    for name in ("KL (nats)", "entropy", "top-1 agrees"):
        table.add_column(name, justify="right")
    targets = r.n_targets > 0
    if targets:
        for name in ("p(target)", "log p(target)", "median rank"):
            table.add_column(name, justify="right")
    for row in r.layers:
        label = f"{row.layer} emb" if row.layer == 0 else str(row.layer)
        if row.layer == r.num_layers:
            label = f"{row.layer} out"
        cells = [label, f"{row.kl:.3f}", f"{row.entropy:.3f}", f"{row.top1_agreement:.1%}"]
        if targets:
            cells += [_num(row.target_prob, ".3g"), _num(row.target_logprob, ".3f")]
            cells.append(_num(row.target_rank_median, "g"))
        table.add_row(*cells, end_section=row.layer == r.num_layers - 1)
    line = f"KL(model's output ‖ lens) and the lens's entropy in nats, at {where} of each prompt"
    if targets:
        line += f"; target statistics over the {r.n_targets} prompts with a target"
    if r.n_skipped:
        line += f"; {r.n_skipped} bad lines skipped"
    return Group(table, Text(line + ".", style="dim"))


def _positions(value: int | str | list[int]) -> str:
    return ",".join(str(p) for p in value) if isinstance(value, list) else str(value)


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


register_view(LensSummaryReport, render)
