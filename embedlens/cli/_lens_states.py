"""`embedlens lens MODEL --states FILE`: the lens on hidden states a file holds."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from embedlens.cli._output import note
from embedlens.cli._run import run_report, say_notes
from embedlens.errors import UsageError
from embedlens.options import LensOptions, LoadOptions

if TYPE_CHECKING:
    from embedlens.reports.lens import LensReport


def run_states(model: str, given: dict[str, Any], load: LoadOptions, asked: LensOptions) -> None:
    """`lens` with --states: what does not apply to a states file refused, then the file decoded
    and the report printed; `given`: every argument of `lens`, `load` and `asked` the options
    it built (of which a states file takes those `lens_states` does: the others are refused
    here by their option's name, or left aside as the command always did)."""
    from embedlens.analysis.lens import lens_states

    states: Path | None = given["states"]

    def check() -> None:
        if states is None:
            raise UsageError("--state-layers applies with --states FILE")
        for option, name in _NOT_WITH.items():
            if given[name] not in (None, False, []):
                what = "the file holds the ids" if option == "PROMPT" else "not with --states"
                raise UsageError(f"{option} does not apply to --states ({what})")
        if given["device"] != "cpu":
            raise UsageError("--states decodes on the CPU: --device does not apply")

    taken = LoadOptions(revision=load.revision, dtype=load.dtype,
                        trust_remote_code=load.trust_remote_code)  # fmt: skip
    shown = LensOptions(layers=asked.layers, top_k=asked.top_k, position=asked.position,
                        target=asked.target, tuned=asked.tuned, jacobian=asked.jacobian,
                        site=asked.site, threshold=asked.threshold)  # fmt: skip
    layers, against = given["state_layers"], given["against"]

    def work() -> LensReport:
        return lens_states(model, states or Path(), state_layers=layers, load=taken,
                           options=shown, against=against,
                           against_revision=given["against_revision"])  # fmt: skip

    run_report(
        model if against is None else f"{model} against {against}", work,
        as_json=given["as_json"], quiet=given["quiet"], debug=given["debug"],
        device=given["device"], doing="Decoding the states with", check=check, say=_say,
    )  # fmt: skip


_NOT_WITH = {
    "PROMPT": "prompt",
    "--prompts": "prompts",
    "--chat": "chat",
    "--no-thinking": "no_thinking",
    "--template-arg": "template_arg",
    "--chat-template": "chat_template",
    "--device-map": "device_map",
    "--save-states": "save_states",
    "--plot": "plot",
    "--compare-logit": "compare_logit",
}
"""What a states file refuses, by option and `lens`'s argument."""


def _say(report: LensReport) -> None:
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
