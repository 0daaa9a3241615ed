"""`embedlens addr`: compute a row's address, then prove it by reading the row back."""

from __future__ import annotations

from typing import Annotated

import typer

from embedlens.cli._errors import handles_errors
from embedlens.cli._options import (
    DebugOpt,
    JsonOpt,
    MatrixOpt,
    ModelArg,
    QuietOpt,
    RevisionOpt,
)
from embedlens.cli._run import run_report

EXAMPLES = (
    "Examples:\n\n"
    "  $ embedlens addr Qwen/Qwen3-0.6B 42 ' king'\n\n"
    "  $ embedlens addr ./SmolLM2-135M-Instruct.Q4_1.gguf ' cat' --tokens 16384\n\n"
    "  $ embedlens addr ./my-model 42 --tp 8 --json"
)


@handles_errors
def addr(
    model: ModelArg,
    rows: Annotated[
        list[str],
        typer.Argument(
            metavar="ROW...",
            help="A row id (an integer), or a token's text (its first token is used). A text "
            "wholly inside one pair of quotes is the text between them: \"' king'\" is ' king' "
            "with its leading space, \"'42'\" the token 42 (not row 42).",
            show_default=False,
        ),
    ],
    matrix: MatrixOpt = "input",
    tokens: Annotated[
        int | None,
        typer.Option("--tokens", help="Also give the bytes a batch of N lookups reads."),
    ] = None,
    tp: Annotated[
        int | None,
        typer.Option("--tp", help="Tensor-parallel size: which rank holds each row (as vLLM)."),
    ] = None,
    check: Annotated[
        bool,
        typer.Option(
            "--check/--no-check",
            help="Read each row back from the file and compare it with the format's own "
            "loader (gguf's reader takes seconds on a large vocabulary).",
        ),
    ] = True,
    as_json: JsonOpt = False,
    revision: RevisionOpt = None,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Compute where each row of the embedding table lives, then read it back to prove it.

    The arithmetic needs only the checkpoint's headers: shape, dtype, strides, the row's offset
    in the tensor and in the file, the cost of a lookup against a one-hot product, and with --tp
    the rank that holds the row. The check reads just those rows' bytes.
    """
    from embedlens.analysis.addr import addr as find_addr

    run_report(
        model,
        lambda: find_addr(
            model, rows, matrix=matrix, tokens=tokens, tp=tp, check=check, revision=revision
        ),
        as_json=as_json,
        quiet=quiet,
        debug=debug,
    )
