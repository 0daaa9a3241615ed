"""`embedlens params`: who owns the parameters."""

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
    "  $ embedlens params ./SmolLM2-135M-Instruct.Q4_1.gguf\n\n"
    "  $ embedlens params meta-llama/Meta-Llama-3-70B --meta-only\n\n"
    "  $ embedlens params Qwen/Qwen3-0.6B --per-block --json"
)


@handles_errors
def params(
    model: ModelArg,
    meta_only: Annotated[
        bool, typer.Option("--meta-only", help="Build from the config alone; no weights needed.")
    ] = False,
    load: Annotated[
        bool, typer.Option("--load", help="Count from the loaded model (reads all weights).")
    ] = False,
    per_block: Annotated[
        bool, typer.Option("--per-block", help="Also list every block by part.")
    ] = False,
    as_json: JsonOpt = False,
    revision: RevisionOpt = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "cpu",
    trust_remote_code: TrustOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Show who owns the parameters: embedding, LM head, blocks, norms (tied weights once).

    Figures come from the checkpoint's headers when it has safetensors or GGUF weights (no
    weights read, no torch), from the config on the meta device with --meta-only, or from the
    loaded model with --load.
    """
    from embedlens.analysis.params import params as run

    run_report(
        model,
        lambda: run(
            model,
            meta_only=meta_only,
            per_block=per_block,
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
