"""`embedlens lens MODEL --states FILE`: the lens on hidden states a file holds."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from embedlens.cli._output import note
from embedlens.cli._run import run_report, say_notes
from embedlens.errors import UsageError

if TYPE_CHECKING:
    from embedlens.reports.states import StatesLensReport


def run_states(
    model: str,
    states: Path | None,
    state_layers: str | None,
    given: dict[str, Any],
    *,
    as_json: bool,
    quiet: bool,
    debug: bool,
    device: str,
    **options: Any,
) -> None:
    """Check what does not apply to a states file, then decode it and print the report."""
    from embedlens.analysis.lens import lens_states

    def check() -> None:
        if states is None:
            raise UsageError("--state-layers applies with --states FILE")
        for name, value in given.items():
            if value is not None and value != []:
                what = "the file holds the ids" if name == "PROMPT" else "not with --states"
                raise UsageError(f"{name} does not apply to --states ({what})")
        if device != "cpu":
            raise UsageError("--states decodes on the CPU: --device does not apply")

    run_report(
        model,
        lambda: lens_states(model, states or Path(), state_layers=state_layers, **options),
        as_json=as_json, quiet=quiet, debug=debug, device=device,
        doing="Decoding the states with", check=check, say=_say,
    )  # fmt: skip


def _say(report: StatesLensReport) -> None:
    """On stderr: a check that failed or was not made, then the notes."""
    from embedlens.cli._output import warn

    said = report.states
    if said is not None and not said.checked:
        note("note: self-check " + said.check)
    elif not report.check.ok:
        c = report.check
        warn(
            f"the decoding of the last layer does not reproduce the logits the file holds "
            f"(max |Δ| = {c.max_abs_logit_diff:.3g} > {c.tolerance:.3g})"
        )
    say_notes(report)
