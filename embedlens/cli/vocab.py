"""`embedlens vocab`: is this vocabulary healthy, trained, and the one these weights were trained with?"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from embedlens.cli import _output
from embedlens.cli._errors import handles_errors
from embedlens.cli._options import (
    DebugOpt,
    Dtype,
    JsonOpt,
    ModelArg,
    QuietOpt,
    RevisionOpt,
)
from embedlens.cli._output import plain_progress
from embedlens.cli._run import run_report

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from embedlens.reports.vocab import VocabReport

PROBLEMS_FOUND = 3
"""`vocab --check`'s exit status when the report lists a problem."""

EXAMPLES = (
    "Examples:\n\n"
    "  $ embedlens vocab ./SmolLM2-135M-Instruct.Q4_1.gguf\n\n"
    '  $ embedlens vocab ./my-model --check --quiet > vocab.txt || echo "exit $?"\n\n'
    "  $ embedlens vocab ./my-model --against ./old-tokenizer/tokenizer.json\n\n"
    "  $ embedlens vocab ./my-model --check-fit --tokenizer ./new-tokenizer\n\n"
    "  $ embedlens vocab Qwen/Qwen3-0.6B --verify --max-verify 50 --json"
)


AgainstOpt = Annotated[
    str | None,
    typer.Option(
        "--against",
        metavar="OTHER",
        help="Compare with another vocabulary: a model, a tokenizer folder or tokenizer.json, "
        "or a GGUF.",
    ),
]
CheckFitOpt = Annotated[
    bool,
    typer.Option(
        "--check-fit",
        help="Load the model and measure whether its weights fit the tokenizer (built-in "
        "English and Chinese texts, against ids shifted by one).",
    ),
]
TokenizerOpt = Annotated[
    str | None,
    typer.Option(
        "--tokenizer",
        metavar="OTHER",
        help="Check this tokenizer against the weights instead of the model's own.",
    ),
]
VerifyOpt = Annotated[
    bool,
    typer.Option(
        "--verify", help="Load the model and ask it to repeat each under-trained candidate."
    ),
]
MaxVerifyOpt = Annotated[
    int, typer.Option("--max-verify", metavar="N", help="Candidates --verify asks about.")
]
AllOpt = Annotated[
    bool,
    typer.Option(
        "--all", help="List every candidate in the tables (--json always holds them all)."
    ),
]
CheckOpt = Annotated[
    bool,
    typer.Option(
        "--check",
        help=f"Exit {PROBLEMS_FOUND} when a problem is found (after printing the report), for "
        "scripts; without it the exit status is 0 whatever was found.",
    ),
]
# --dtype, --device and --trust-remote-code apply only to the model --verify and --check-fit load.
VocabDtypeOpt = Annotated[
    Dtype,
    typer.Option("--dtype", help="Dtype --verify and --check-fit load the weights in."),
]
VocabDeviceOpt = Annotated[
    str,
    typer.Option("--device", help="cpu, cuda, mps or auto: where --verify and --check-fit run."),
]
VocabTrustOpt = Annotated[
    bool,
    typer.Option(
        "--trust-remote-code",
        help="Allow a model's own code to run when --verify or --check-fit loads it (off by "
        "default).",
    ),
]


@handles_errors
def vocab(
    model: ModelArg,
    against: AgainstOpt = None,
    check_fit: CheckFitOpt = False,
    tokenizer: TokenizerOpt = None,
    verify: VerifyOpt = False,
    max_verify: MaxVerifyOpt = 20,
    all_tokens: AllOpt = False,
    check: CheckOpt = False,
    as_json: JsonOpt = False,
    revision: RevisionOpt = None,
    dtype: VocabDtypeOpt = "auto",
    device: VocabDeviceOpt = "cpu",
    trust_remote_code: VocabTrustOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Check the vocabulary against the weights: rows, unreachable and under-trained tokens.

    Without --verify and --check-fit it reads the headers, the tokenizer and the head and
    embedding (one matrix when tied), never torch. The fingerprint is a SHA-256 of the
    vocabulary (ids, token bytes, special tokens) to store beside the weights and compare at
    start-up. With --check the exit status is 3 when a problem is found.
    """
    from embedlens import vocab as run  # runtime.tune_for_command: one BLAS thread

    def work() -> VocabReport:
        with _Bar(quiet or not verify) as bar:  # --verify's batches (its own bar, no spinner)
            return run(
                model,
                against=against,
                check_fit=check_fit,
                tokenizer=tokenizer,
                verify=verify,
                max_verify=max_verify,
                show_all=all_tokens,
                revision=revision,
                dtype=dtype,
                device=device,
                trust_remote_code=trust_remote_code,
                progress=bar.update,
            )

    report = run_report(
        model,
        work,
        as_json=as_json,
        quiet=quiet,
        debug=debug,
        device=device,
        spinner=not verify,
    )
    if check and report.problems:
        raise typer.Exit(PROBLEMS_FOUND)


class _Bar:
    """Progress on stderr for --verify's batches: a bar on a terminal, plain lines every few
    seconds off one (neither with --quiet)."""

    def __init__(self, quiet: bool) -> None:
        self._quiet = quiet
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._done = (0, 0)
        self._plain = plain_progress(self._line)

    def __enter__(self) -> _Bar:
        if not self._quiet:
            self._plain.__enter__()
        return self

    def _line(self, seconds: float) -> str:
        done, total = self._done
        if not total:
            return f"Verifying: loading the model, {int(seconds)} s"
        return f"Verifying: {done} of {total} batches, {int(seconds)} s"

    def update(self, stage: str, done: int, total: int, unit: str, detail: str = "") -> None:
        self._done = (done, total)
        if self._quiet or not _output.err_console.is_terminal:
            return
        from rich.progress import Progress

        if self._progress is None or self._task is None:
            self._progress = Progress(console=_output.err_console, transient=True)
            self._progress.start()
            self._task = self._progress.add_task("Verifying", total=total)
        self._progress.update(self._task, completed=done)

    def __exit__(self, *exc: object) -> None:
        if not self._quiet:
            self._plain.__exit__(None, None, None)
        if self._progress is not None:
            self._progress.stop()
