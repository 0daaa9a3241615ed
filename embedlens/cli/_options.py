"""Options shared by every command, as Annotated aliases."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from embedlens.cli._output import check_stdout, set_quiet

ModelArg = Annotated[
    str,
    typer.Argument(
        metavar="MODEL", help="Hub repo id, local model folder, or .gguf file.", show_default=False
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Write one JSON object to stdout.")]
RevisionOpt = Annotated[
    str | None, typer.Option("--revision", help="Hub revision: branch, tag or commit.")
]
DtypeOpt = Annotated[
    str,
    typer.Option(
        "--dtype", help="auto, float32, bfloat16 or float16 (for commands that load weights)."
    ),
]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda, mps or auto.")]
TrustOpt = Annotated[
    bool,
    typer.Option("--trust-remote-code", help="Allow a model's own code to run (off by default)."),
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress or notes on stderr.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")]


def common(*, quiet: bool, debug: bool, dtype: str, device: str) -> None:
    """Apply --quiet and --debug, and check --dtype and --device before any work."""
    from embedlens.errors import UsageError
    from embedlens.model.loading import DEVICES, DTYPES
    from embedlens.model.preflight import memory_limit_override

    set_quiet(quiet)
    if debug:
        os.environ["EMBEDLENS_DEBUG"] = "1"
    check_stdout()
    memory_limit_override()  # a bad EMBEDLENS_MEMORY_LIMIT is refused before any work
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype '{dtype}'", hint="use one of: " + ", ".join(DTYPES))
    if device not in DEVICES and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise UsageError(f"unknown device '{device}'", hint="use one of: " + ", ".join(DEVICES))
