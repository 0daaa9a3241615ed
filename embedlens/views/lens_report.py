"""How the two lens report shapes are shown, each with the parts it holds: one prompt's
(`LensReport`: the lens's tables, or with `diff` A against B, with `sites` the rows inside the
blocks, with both where inside them the two part) and the `--prompts` summary (the same, over
the prompts: one row per layer of statistics)."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from embedlens.reports import register_view
from embedlens.reports.lens import LensLayerStats, LensReport, LensSummaryReport
from embedlens.views import lens, lens_diff, sites
from embedlens.views.format import Sheet, lens_name, shown


def render(r: LensReport) -> RenderableType:
    """One prompt's tables, with its parts'."""
    if r.sites is not None and r.diff is not None:
        return sites.render_sites_pair(r, lens_diff.render(r))
    if r.sites is not None:
        return sites.render(r)
    return lens_diff.render(r) if r.diff is not None else lens.render(r)


def render_summary(r: LensSummaryReport) -> RenderableType:
    """The summary's tables, with its parts'."""
    if r.sites is not None and r.diff is not None:
        over = f" over {r.n_prompts} prompts"
        return sites.render_sites_pair(r, lens_diff.render_summary(r), over)
    if r.sites is not None:
        return sites.render_summary(r)
    return lens_diff.render_summary(r) if r.diff is not None else _summary(r)


def _summary(r: LensSummaryReport) -> RenderableType:
    """The per-layer table, and a line saying what it was taken over."""
    where = {-1: "the last position"}.get(r.position) if isinstance(r.position, int) else None
    if where is None:
        where = "every position" if r.position == "all" else f"positions {_positions(r.position)}"
    title = (
        f"{lens_name(r)} of {r.display_model} over {r.n_prompts} prompts "
        f"({r.n_positions} positions, {r.dtype})"
    )
    table = Sheet(title=shown(title, "table.title"))
    logit = {row.layer: row for row in r.logit_layers or []}
    names = ["KL (nats)", "entropy", "top-1 agrees"]
    if logit:  # --compare-logit: the logit lens beside the tuned lens
        names += ["logit KL", "logit top-1"]
    targets = r.n_targets > 0
    if targets:
        names += ["p(target)", "log p(target)", "median rank"]
    # with targets, the rank shown is the target's ("median rank"); without, the next token's
    ranked = not targets and any(row.next_rank_median is not None for row in r.layers)
    names += ["next rank"] if ranked else []
    # Headers wrap at their spaces on a narrow terminal; the figures never do.
    table.add_column("layer", justify="right", no_wrap=True)
    for name in names:
        table.add_column(name, justify="right")
    for row in r.layers:
        other = logit.get(row.layer)
        cells = _cells(r, row, other, targets)
        cells += [_num(row.next_rank_median, "g")] if ranked else []
        table.add_row(*cells, end_section=row.layer == r.num_layers - 1)
    line = f"KL(model's output ‖ lens) and the lens's entropy in nats, at {where} of each prompt"
    if targets:
        line += f"; target statistics over the {r.n_targets} prompts with a target"
    if ranked:
        line += "; next rank: the median rank by logit of the token after each position read"
    if logit:
        line += "; logit KL and logit top-1: the logit lens on the same prompts"
    if r.n_skipped:
        line += f"; {r.n_skipped} bad lines skipped"
    return Group(table, Text(line + ".", style="dim"))


def _cells(
    r: LensSummaryReport, row: LensLayerStats, logit: LensLayerStats | None, targets: bool
) -> list[str]:
    """One layer's row: its label and statistics (the logit lens's beside, when compared)."""
    label = f"{row.layer} emb" if row.layer == 0 else str(row.layer)
    if row.layer == r.num_layers:
        label = f"{row.layer} out"
    cells = [label, f"{row.kl:.3f}", f"{row.entropy:.3f}", f"{row.top1_agreement:.1%}"]
    if logit is not None:
        cells += [f"{logit.kl:.3f}", f"{logit.top1_agreement:.1%}"]
    if targets:
        cells += [_num(row.target_prob, ".3g"), _num(row.target_logprob, ".3f")]
        cells.append(_num(row.target_rank_median, "g"))
    return cells


def _positions(value: int | str | list[int]) -> str:
    return ",".join(str(p) for p in value) if isinstance(value, list) else str(value)


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


register_view(LensReport, render)
register_view(LensSummaryReport, render_summary)
