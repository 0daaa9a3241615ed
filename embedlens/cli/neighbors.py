"""`embedlens neighbors`: the nearest rows of the embedding table by cosine."""

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
from embedlens.model.words import Pool

EXAMPLES = (
    "Examples:\n\n"
    "  $ embedlens neighbors ./SmolLM2-135M-Instruct.Q4_1.gguf ' king' ' cat' -k 5\n\n"
    "  $ embedlens neighbors Qwen/Qwen3-0.6B \"' king' - ' man' + ' woman'\"\n\n"
    "  $ embedlens neighbors ./my-model --id 42 --matrix output --json"
)


QueriesArg = Annotated[
    list[str] | None,
    typer.Argument(
        metavar="QUERY...",
        help="Words or expressions such as "
        '"king - man + woman" (an expression\'s words are stripped). A word wholly inside one '
        "pair of quotes is the text between them, spaces kept: \"' king'\" is ' king'. "
        "A word of several tokens is queried as --pool says.",
        show_default=False,
    ),
]

IdsOpt = Annotated[
    list[int] | None,
    typer.Option("--id", help="Query a row by id (repeatable).", show_default=False),
]

IncludeSpecialOpt = Annotated[
    bool, typer.Option("--include-special", help="Search special tokens' rows too.")
]

PoolOpt = Annotated[
    Pool,
    typer.Option(
        "--pool",
        help="A word of several tokens: its first token's row, the mean of all its "
        "tokens' unit rows, or its last token's row.",
    ),
]


@handles_errors
def neighbors(
    model: ModelArg,
    queries: QueriesArg = None,
    k: Annotated[int, typer.Option("-k", "--top-k", help="Neighbours per query.")] = 5,
    ids: IdsOpt = None,
    matrix: MatrixOpt = "input",
    include_special: IncludeSpecialOpt = False,
    pool: PoolOpt = "first",
    as_json: JsonOpt = False,
    revision: RevisionOpt = None,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Find the nearest tokens to each query by cosine in the embedding (or head) matrix.

    Only that one matrix is read (memory-mapped from safetensors, or dequantised from GGUF),
    and only real tokens' rows are searched: padding rows past the tokenizer's length never
    are, special tokens only with --include-special, and a query's own rows never appear.
    """
    from embedlens import neighbors as find_neighbors  # runtime.tune_for_command: one BLAS thread

    run_report(
        model,
        lambda: find_neighbors(
            model,
            queries or [],
            top_k=k,
            ids=ids or [],
            matrix=matrix,
            include_special=include_special,
            pool=pool,
            revision=revision,
        ),
        as_json=as_json,
        quiet=quiet,
        debug=debug,
    )
