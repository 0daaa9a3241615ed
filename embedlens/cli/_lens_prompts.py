"""`embedlens lens MODEL --prompts FILE`: many prompts, one load, a summary of every layer."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from embedlens.cli._output import counter, emit, note, rendered, warn, write_stdout
from embedlens.errors import UsageError
from embedlens.options import LensOptions, LoadOptions
from embedlens.runtime import world
from embedlens.text import model_title

if TYPE_CHECKING:
    from embedlens.model.prompts import PromptLine
    from embedlens.reports.lens import LensReport, LensSummaryReport


def run_prompts(
    model: str,
    prompt: str | None,
    prompts: str | None,
    *,
    each: bool,
    as_json: bool,
    plot: Path | None,
    load: LoadOptions,
    asked: LensOptions,
    more: dict[str, Any],
) -> None:
    """Run the lens over a file of prompts: per-prompt output as it comes, the summary last;
    `more`: `lens_prompts`'s other arguments (--against, --dist-backend)."""
    from embedlens.analysis.lens import lens_prompts
    from embedlens.analysis.lens.options import one_prompt_only
    from embedlens.model.prompts import PromptSource

    if prompts is None:
        raise UsageError("give a PROMPT, or --prompts FILE (- for stdin)")
    if prompt is not None:
        raise UsageError("give either PROMPT or --prompts, not both")
    rank, size = world()
    if prompts == "-" and size > 1:
        raise UsageError(
            "--prompts - reads stdin, which the processes torchrun starts do not share",
            hint="give a file every process can read",
        )
    one_prompt_only(asked.target, asked.chat, False)
    asked = replace(asked, target=None, chat=None)
    if plot is not None:
        from embedlens.views.heatmap import check_plot_file

        check_plot_file(plot)
    if not (as_json or each):  # only the summary is printed, and it reads each prompt's top-1
        asked = replace(asked, top_k=min(asked.top_k, 1))
    show = _Shown(as_json=as_json, each=each)
    source = PromptSource.open(prompts)
    against = more.get("against")
    what = model_title(model)
    if against is not None:
        what = f"{what} against {model_title(str(against))}"
    with counter(f"Running the lens on {what}", "prompts") as advance:

        def on_report(report: LensReport, line: PromptLine) -> None:
            show.report(report, line)
            advance()

        summary = lens_prompts(model, source, load=load, options=asked, on_report=on_report, **more)
    if rank != 0:  # under torchrun, rank 0 prints every prompt's output and the summary
        return
    show.finish(summary, plot)
    emit(summary, as_json=as_json)
    if more.get("save_states") is not None:
        note(f"wrote each prompt's states to {more['save_states']} (a file a line)")


class _Shown:
    """What each prompt prints: its JSON line, or its table with --each; notes once each."""

    def __init__(self, *, as_json: bool, each: bool) -> None:
        self.as_json = as_json
        self.each = each
        self.noted: set[str] = set()
        self.unfaithful = 0

    def report(self, report: LensReport, line: PromptLine) -> None:
        if not report.check.ok:
            self.unfaithful += 1
        self.notes(report.notes)
        if self.as_json:
            write_stdout(json_line(report, line.id))
        elif self.each:
            write_stdout(rendered(report.__rich__()))

    def notes(self, notes: list[str]) -> None:
        for text in notes:
            if text not in self.noted:
                self.noted.add(text)
                note("note: " + text)

    def finish(self, summary: LensSummaryReport, plot: Path | None) -> None:
        """The warning when some prompts were not faithful, the notes, then the plot."""
        if self.unfaithful:
            warn(
                f"the lens does not reproduce this model's logits on {self.unfaithful} of "
                f"{summary.n_prompts} prompts: its rows are not faithful for this architecture "
                "(run one of them alone to see the suspect step)"
            )
        diff = summary.diff
        if diff is not None and diff.n_against_unfaithful:
            warn(
                f"the lens does not reproduce the logits of '{diff.against}' on "
                f"{diff.n_against_unfaithful} of {summary.n_prompts} prompts: its rows "
                "are not faithful for this architecture"
            )
        self.notes(summary.notes)
        if plot is not None and diff is not None:
            from embedlens.views.lens_diff import save_diff_curves

            save_diff_curves(summary, plot)
            note(f"wrote {plot}")
        elif plot is not None:
            from embedlens.views.curves import save_curves

            save_curves(summary, plot)
            note(f"wrote {plot}")


def json_line(report: LensReport, ident: str | int | None) -> str:
    """The single run's JSON object on one line, with the line's `id` when it has one."""
    if ident is None:
        return report.to_json() + "\n"
    data = {**report.to_dict(), "id": ident}
    text = json.dumps(data, ensure_ascii=False, allow_nan=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(data, ensure_ascii=True, allow_nan=False)
    return text + "\n"
