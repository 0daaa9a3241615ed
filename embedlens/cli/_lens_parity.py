"""`embedlens lens ... --against-states B` or `--against-dtype D`: parity of two runs of the same
weights, layer by layer (docs/parity.md)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from embedlens.cli._options import Dtype
from embedlens.errors import UsageError

if TYPE_CHECKING:
    from embedlens.reports.lens_parity import LensParityReport


def _option(name: str, help: str, metavar: str | None = None) -> Any:
    flag = "--" + name.replace("_", "-")
    return typer.Option(flag, help=help, rich_help_panel="Comparison", metavar=metavar)


AgainstStatesOpt = Annotated[
    Path | None,
    _option(
        "against_states",
        "Parity: B is the states of the same tokens another run saved (a file, or a folder of "
        "them a file per prompt: --save-states', vLLM's, or the plain layout of docs/parity.md); "
        "A is --states, or MODEL run on B's ids. Per layer the RMS relative difference, cosine "
        "and KL; at the output δ = log π_A − log π_B.",
        metavar="FILE|DIR",
    ),
]
AgainstDtypeOpt = Annotated[
    Dtype | None,
    _option(
        "against_dtype",
        "Parity: B is --against (MODEL by default) run in this dtype, A in --dtype: one model in "
        "two precisions, compared as --against-states compares two runs.",
    ),
]
HeadDtypeOpt = Annotated[
    Dtype | None,
    _option(
        "head_dtype",
        "Parity: decode both sides' final norm and head in this dtype (float32 while the blocks "
        "run in bfloat16, as RL stacks do); by default each side's own.",
    ),
]
CapOpt = Annotated[
    float | None,
    _option(
        "cap",
        "Parity: the cap on each sequence's importance ratio exp(Σ δ) (3.0, TRL's "
        "vllm_importance_sampling_cap).",
        metavar="RATIO",
    ),
]

_NOT_WITH = {
    "--each": "each",
    "--save-states": "save_states",
    "--save-logits": "save_logits",
    "--against-logits": "against_logits",
    "--compare-logit": "compare_logit",
    "--tuned": "tuned",
    "--jacobian": "jacobian",
    "--target": "target",
    "--skip-bad": "skip_bad",
}
"""What a parity run refuses, by option and `lens`'s argument."""


def wanted(given: dict[str, Any]) -> bool:
    """Whether the command asks for a parity run (or one of its options alone)."""
    return any(
        given[k] is not None for k in ("against_states", "against_dtype", "head_dtype", "cap")
    )


def run_parity(model: str, given: dict[str, Any]) -> None:
    """The checks, the run under a spinner, the report, the warnings and the plot."""
    from embedlens.cli._run import run_report

    plot: Path | None = given["plot"]

    def check() -> None:
        if given["against_states"] is None and given["against_dtype"] is None:
            raise UsageError(
                "--head-dtype and --cap apply to a parity run: give --against-states FILE or "
                "--against-dtype DTYPE"
            )
        for option, name in _NOT_WITH.items():
            if given[name] not in (None, False, []):
                raise UsageError(f"{option} does not apply to a parity run (docs/parity.md)")
        if given["position"] != "-1" or given["top_k"] != 5:
            raise UsageError(
                "--position and -k do not apply to a parity run (it reads every "
                "position, and ranks by top-1)"
            )
        if plot is not None:
            from embedlens.views.heatmap import check_plot_file

            check_plot_file(plot)

    def work() -> LensParityReport:
        return _call(model, given)

    against = given["against_states"] or given["against"] or model
    run_report(
        f"{model} against {against}",
        work,
        as_json=given["as_json"],
        quiet=given["quiet"],
        debug=given["debug"],
        device=given["device"],
        doing="Comparing the runs of",
        check=check,
        say=lambda r: _say(r, plot),
        split=True,
    )


def _say(report: LensParityReport, plot: Path | None) -> None:
    """On stderr: a side whose decoding did not reproduce its model's logits, the notes, the
    plot."""
    from embedlens.cli._output import note, warn

    for name, side in (("A", report.a), ("B", report.b)):
        if side.ok is False:
            warn(
                f"{name}'s decoding does not reproduce its model's logits ({side.check}): its "
                "rows are not faithful"
            )
    for text in report.notes:
        note("note: " + text)
    if plot is not None:
        from embedlens.views.lens_parity import save_plot

        save_plot(report, plot)
        note(f"wrote {plot}")


def _call(model: str, given: dict[str, Any]) -> LensParityReport:
    """`lens_parity` with the command's options."""
    from embedlens.analysis.lens.parity_run import lens_parity
    from embedlens.analysis.lens.parity_sources import TextAsk
    from embedlens.model.prompts import PromptSource

    text = given["text"]
    ask = (
        None
        if text is None
        else TextAsk(text, given["ctx"], given["stride"], given["score"], given["max_tokens"])
    )
    prompts = given["prompts"]
    return lens_parity(
        model,
        given["prompt"],
        states=given["states"],
        against_states=given["against_states"],
        against=given["against"],
        against_dtype=given["against_dtype"],
        against_revision=given["against_revision"],
        head_dtype=given["head_dtype"],
        state_layers=given["state_layers"],
        prompts=None if prompts is None else PromptSource.open(prompts),
        text=ask,
        cap=3.0 if given["cap"] is None else given["cap"],
        revision=given["revision"],
        dtype=given["dtype"],
        device=given["device"],
        trust_remote_code=given["trust_remote_code"],
        dist_backend=given["dist_backend"],
        site=given["site"],
        layers=given["layers"],
        threshold=given["threshold"],
        chat=given["chat"],
        no_thinking=given["no_thinking"],
        template_args=given["template_arg"],
        chat_template=given["chat_template"],
    )
