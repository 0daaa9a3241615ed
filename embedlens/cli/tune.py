"""`embedlens tune`: fit a tuned lens to a model, evaluate it on held-out text, write it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from embedlens.cli import _output
from embedlens.cli._errors import handles_errors
from embedlens.cli._options import (
    DebugOpt,
    DeviceOpt,
    DistBackendOpt,
    JsonOpt,
    ModelArg,
    QuietOpt,
    RevisionOpt,
    TrustOpt,
    common,
)
from embedlens.cli._output import elapsed, emit, note, plain_progress
from embedlens.options import LoadOptions
from embedlens.runtime import world
from embedlens.text import model_title

if TYPE_CHECKING:
    from embedlens.progress import Progress

EXAMPLES = (
    "Examples:\n\n"
    "  $ embedlens tune ./SmolLM2-135M-Instruct.Q4_1.gguf --data text.txt --out smol-lens\n\n"
    '  $ embedlens lens ./SmolLM2-135M-Instruct.Q4_1.gguf "The capital of France is" --tuned '
    "smol-lens\n\n"
    "  $ embedlens tune ./my-model --data corpus.jsonl --eval held-out.txt --out lens --json\n\n"
    "  $ embedlens tune ./my-model --data text.txt --out lens --method affine --tokens 100000\n\n"
    "  $ embedlens tune ./my-model --data text.txt --out lens --jacobian --estimator sketch"
)

DataOpt = Annotated[
    Path,
    typer.Option(
        "--data",
        metavar="FILE",
        help="Text to tune on: UTF-8 text (documents separated by blank lines) or JSON Lines "
        "with a 'text' field; read as far as --tokens (and --eval-tokens held out at its tail "
        "without --eval).",
        show_default=False,
    ),
]
OutOpt = Annotated[
    Path,
    typer.Option(
        "--out",
        metavar="DIR",
        help="The lens folder to write (new or empty): config.json and params.safetensors, "
        "written whole or not at all.",
        show_default=False,
    ),
]
EvalOpt = Annotated[
    Path | None,
    typer.Option(
        "--eval",
        metavar="FILE",
        help="Held-out text for the evaluation (by default the tail of --data after the tokens "
        "fitted).",
    ),
]
SeqLenOpt = Annotated[
    int | None,
    typer.Option(
        "--seq-len", help="Tokens per sequence (512, or the model's context when shorter)."
    ),
]
TokensOpt = Annotated[int, typer.Option("--tokens", help="Tokens of --data to fit on (at most).")]
EvalTokensOpt = Annotated[
    int, typer.Option("--eval-tokens", help="Held-out tokens to evaluate on (at most).")
]
RefineTokensOpt = Annotated[
    int | None,
    typer.Option(
        "--refine-tokens",
        help="Tokens the KL refinement reads, a seeded share of those fitted (2048 by default).",
    ),
]
StepsOpt = Annotated[
    int | None,
    typer.Option("--steps", help="Refinement steps (by default one per 128 tokens it reads)."),
]
LrOpt = Annotated[
    float | None,
    typer.Option(
        "--lr", help="Refinement learning rate, as tuned-lens's lr scale (0.3 by default)."
    ),
]
MethodOpt = Annotated[
    str,
    typer.Option(
        "--method",
        help="kl: least squares, then tuned-lens's KL refinement; affine: least squares alone.",
    ),
]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the refinement's order of rows.")]
JacobianOpt = Annotated[
    bool,
    typer.Option(
        "--jacobian",
        help="Also fit the Jacobian lens (one d x d matrix per layer: the average effect of a "
        "layer's output on the last block's), on the first --jacobian-tokens of the tokens "
        "fitted; written to OUT/jacobian_lens.pt (for `lens --jacobian`) and evaluated beside "
        "the tuned lens.",
    ),
]
EstimatorOpt = Annotated[
    str | None,
    typer.Option(
        "--estimator",
        help="With --jacobian: exact (every output dimension, the reference's estimator; by "
        "default) or sketch (seeded random probes, a multiple of the identity as a control "
        "variate, stopped "
        "when two halves of the probes agree to 0.99 at every layer).",
    ),
]
ProbesOpt = Annotated[
    int | None,
    typer.Option(
        "--probes",
        help="With --estimator sketch: the most probes per sequence (even; by default d/8 "
        "rounded up to whole passes of 8: at most 1/8 of the exact estimator's backward "
        "passes).",
    ),
]
SkipFirstOpt = Annotated[
    int | None,
    typer.Option(
        "--skip-first",
        help="With --jacobian: leading positions of each sequence left out of the fit (16 by "
        "default); the last position is left out too.",
    ),
]
JacobianTokensOpt = Annotated[
    int | None,
    typer.Option(
        "--jacobian-tokens",
        help="With --jacobian: tokens to fit it on, whole sequences, at least one (512 by "
        "default: the exact fit costs d/8 backward passes of 8 copies of each sequence).",
    ),
]
DtypeTuneOpt = Annotated[
    str, typer.Option("--dtype", help="Dtype the model is loaded in (float32 by default).")
]


@handles_errors
def tune(
    model: ModelArg,
    data: DataOpt,
    out: OutOpt,
    eval_file: EvalOpt = None,
    seq_len: SeqLenOpt = None,
    tokens: TokensOpt = 40_000,
    eval_tokens: EvalTokensOpt = 2_048,
    refine_tokens: RefineTokensOpt = None,
    steps: StepsOpt = None,
    lr: LrOpt = None,
    method: MethodOpt = "kl",
    seed: SeedOpt = 0,
    jacobian: JacobianOpt = False,
    estimator: EstimatorOpt = None,
    probes: ProbesOpt = None,
    skip_first: SkipFirstOpt = None,
    jacobian_tokens: JacobianTokensOpt = None,
    as_json: JsonOpt = False,
    revision: RevisionOpt = None,
    dtype: DtypeTuneOpt = "float32",
    device: DeviceOpt = "cpu",
    trust_remote_code: TrustOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
    dist_backend: DistBackendOpt = "auto",
) -> None:
    """Fit a tuned lens to MODEL on --data and write it to --out, for `lens --tuned`.

    One affine translator per layer (h + W h + b, tuned-lens's form), decoded by the model's own
    final norm and head: least squares from streamed statistics, then tuned-lens's KL
    refinement. Prints the held-out evaluation: per layer, the logit lens's and the tuned lens's
    KL to the model's output and cross-entropy, in nats and bits per byte. With --jacobian, the
    Jacobian lens too, fitted on the same text and evaluated beside them.
    """
    from embedlens.analysis.tune import tune as run

    common(quiet=quiet, debug=debug, device=device, split=True)
    load = LoadOptions(revision=revision, dtype=dtype, device=device,
                       trust_remote_code=trust_remote_code)  # fmt: skip
    rank = world()[0]  # under torchrun, rank 0 alone shows progress, notes and the report
    with _progress(quiet or rank != 0, model) as shown:
        report = run(
            model, data, out, eval_data=eval_file, seq_len=seq_len, tokens=tokens,
            eval_tokens=eval_tokens, refine_tokens=refine_tokens, steps=steps, lr=lr,
            method=method, seed=seed, jacobian=jacobian, estimator=estimator, probes=probes,
            skip_first=skip_first, jacobian_tokens=jacobian_tokens, progress=shown, load=load,
            dist_backend=dist_backend,
        )  # fmt: skip
    if rank != 0:
        return
    for text in report.notes:
        note("note: " + text)
    note(f"wrote {report.out}")
    emit(report, as_json=as_json)


@contextmanager
def _progress(quiet: bool, model: str) -> Iterator[Progress | None]:
    """Bars on stderr, one per phase (tokens fitted, layers solved, check sequences, refinement
    steps with the KL of each band of layers, tokens evaluated) on a terminal; off one, a plain line of the latest phase every
    PLAIN_EVERY seconds (`plain_progress`); nothing with --quiet."""
    if quiet:
        yield None
        return
    if not _output.err_console.is_terminal:
        latest = ["loading the model and reading the data"]
        what = f"Tuning a lens on {model_title(model)}"

        def seen(phase: str, done: int, total: int, unit: str, detail: str = "") -> None:
            latest[0] = f"{phase} {done:,}/{total:,} {unit}" + (f" ({detail})" if detail else "")

        with plain_progress(lambda t: f"{latest[0]}, {elapsed(t)}: {what}"):
            yield seen
        return
    from rich.progress import BarColumn, TaskID, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as Bars

    columns = (
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        TextColumn("{task.completed:,.0f}/{task.total:,.0f}"),
        TimeElapsedColumn(),
        TextColumn("{task.fields[detail]}", markup=False),
    )
    with Bars(*columns, console=_output.err_console, transient=True) as bar:
        tasks: dict[str, TaskID] = {}

        def update(phase: str, done: int, total: int, unit: str, detail: str = "") -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=total, detail="")
            bar.update(tasks[phase], completed=done, total=total, detail=detail)

        yield update
