"""Options shared by every command, as Annotated aliases."""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

import typer

from embedlens.cli._output import check_stdout, note, set_quiet
from embedlens.compat import report_to
from embedlens.errors import UsageError
from embedlens.runtime import world

ModelArg = Annotated[
    str,
    typer.Argument(
        metavar="MODEL",
        help="Hub repo id (REPO:FILE.gguf: a GGUF file in it), local model folder, or .gguf file.",
        show_default=False,
    ),
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Write one JSON object to stdout.", rich_help_panel="Output")
]
RevisionOpt = Annotated[
    str | None,
    typer.Option(
        "--revision", help="Hub revision: branch, tag or commit.", rich_help_panel="Loading"
    ),
]
AgainstRevisionOpt = Annotated[
    str | None,
    typer.Option(
        "--against-revision",
        help="Hub revision of the --against model.",
        rich_help_panel="Comparison",
    ),
]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
DtypeOpt = Annotated[
    Dtype,
    typer.Option("--dtype", help="Dtype the weights are loaded in (with --load or --meta-only)."),
]
DeviceMap = Literal["auto", "balanced", "balanced_low_0", "sequential"]
"""The --device-map choices (analysis.lens.DEVICE_MAPS checks the same ones from Python)."""

Matrix = Literal["input", "output"]
MatrixOpt = Annotated[
    Matrix, typer.Option("--matrix", help="input (the embedding) or output (the LM head).")
]
DeviceOpt = Annotated[
    str, typer.Option("--device", help="cpu, cuda, mps or auto.", rich_help_panel="Loading")
]
TrustOpt = Annotated[
    bool,
    typer.Option(
        "--trust-remote-code",
        help="Allow a model's own code to run (off by default).",
        rich_help_panel="Loading",
    ),
]
QuietOpt = Annotated[
    bool,
    typer.Option(
        "--quiet", "-q", help="No progress or notes on stderr.", rich_help_panel="Runtime"
    ),
]
DebugOpt = Annotated[
    bool, typer.Option("--debug", help="Show tracebacks for errors.", rich_help_panel="Runtime")
]
DistBackend = Literal["auto", "gloo", "nccl"]
DistBackendOpt = Annotated[
    DistBackend,
    typer.Option(
        "--dist-backend",
        help="Under torchrun: the process group's backend (auto: NCCL for a model on CUDA, "
        "else gloo). Ignored when run alone.",
        rich_help_panel="Runtime",
    ),
]


def common(*, quiet: bool, debug: bool, device: str | None = None, split: bool = False) -> None:
    """Apply --quiet and --debug, and check --device (and the memory limit) before any work.

    Under torchrun (WORLD_SIZE above 1), a command that `split`s over processes joins the
    run's store, and only rank 0 prints progress and notes; any other is refused."""
    from embedlens.model.loading import check_device
    from embedlens.model.preflight import memory_limit_override

    set_quiet(quiet)
    report_to(lambda text: note("note: " + text))  # a shortcut not taken: one line on stderr
    if debug:
        os.environ["EMBEDLENS_DEBUG"] = "1"
    check_stdout()
    memory_limit_override()  # a bad EMBEDLENS_MEMORY_LIMIT is refused before any work
    if device is not None:
        check_device(device)
    _split_run(split)


def _split_run(split: bool) -> None:
    """Under torchrun: refuse a command that runs in one process; else join the run's store,
    rank 0 alone printing progress and notes."""
    rank, size = world()
    if size == 1:
        return
    if not split:
        raise UsageError(
            f"WORLD_SIZE is {size} (torchrun): embedlens splits only `lens --prompts` and "
            "`tune` over processes",
            hint="run this command alone, without torchrun",
        )
    from embedlens.analysis.torchrun import cli_session
    from embedlens.cli._errors import attach

    if rank != 0:
        set_quiet(True)
    session = cli_session()
    if session is not None:
        attach(session)


def counted(load: bool, **keywords: Any) -> dict[str, Any]:
    """`params`' and `tied`'s loading arguments from the options: with --load, a `LoadOptions`
    of them as `load=`; without, the options as keywords (the headers are read)."""
    from embedlens.options import LoadOptions

    return {"load": LoadOptions(**keywords)} if load else keywords
