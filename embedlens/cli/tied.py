"""`embedlens tied`: does the head share the embedding's memory."""

from __future__ import annotations

from typing import Annotated

import typer

from embedlens.cli._errors import handles_errors
from embedlens.cli._options import (
    DebugOpt,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    ModelArg,
    QuietOpt,
    RevisionOpt,
    TrustOpt,
    counted,
)
from embedlens.cli._run import run_report

EXAMPLES = (
    "Examples:\n\n"
    "  $ embedlens tied ./my-model\n\n"
    "  $ embedlens tied Qwen/Qwen3-0.6B --meta-only\n\n"
    "  $ embedlens tied ./my-model --load --json"
)


@handles_errors
def tied(
    model: ModelArg,
    meta_only: Annotated[
        bool,
        typer.Option("--meta-only", help="Build from the config on the meta device (no weights)."),
    ] = False,
    load: Annotated[
        bool, typer.Option("--load", help="Load the weights and compare data_ptr().")
    ] = False,
    as_json: JsonOpt = False,
    revision: RevisionOpt = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "cpu",
    trust_remote_code: TrustOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Say whether the LM head shares the embedding's storage, and what that saves.

    Evidence is shown piece by piece: the config's flag, whether the checkpoint stores a head
    matrix, and (with --meta-only or --load) whether the built model's head is the embedding.
    """
    from embedlens.analysis.tied import tied as run

    run_report(
        model,
        lambda: run(
            model,
            meta_only=meta_only,
            **counted(
                load,
                revision=revision,
                dtype=dtype,
                device=device,
                trust_remote_code=trust_remote_code,
            ),
        ),
        as_json=as_json,
        quiet=quiet,
        debug=debug,
        device=device,
    )
