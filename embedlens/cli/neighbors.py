"""`embedlens neighbors`: the nearest rows of the embedding table by cosine."""

from __future__ import annotations

import os
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
    common,
)
from embedlens.cli._output import emit, note, progress

EXAMPLES = (
    "Examples:\n\n"
    "  $ embedlens neighbors ./SmolLM2-135M-Instruct.Q4_1.gguf ' king' ' cat' -k 5\n\n"
    "  $ embedlens neighbors Qwen/Qwen3-0.6B \"' king' - ' man' + ' woman'\"\n\n"
    "  $ embedlens neighbors ./my-model --id 42 --matrix output --json"
)


@handles_errors
def neighbors(
    model: ModelArg,
    queries: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="QUERY...",
            help="Words or expressions such as "
            '"king - man + woman" (words stripped; quote one to keep its spaces: "\' king\'"). '
            "A word of several tokens is queried as --pool says.",
            show_default=False,
        ),
    ] = None,
    k: Annotated[int, typer.Option("-k", "--top-k", help="Neighbours per query.")] = 5,
    ids: Annotated[
        list[int] | None,
        typer.Option("--id", help="Query a row by id (repeatable).", show_default=False),
    ] = None,
    matrix: Annotated[
        str, typer.Option("--matrix", help="input (the embedding) or output (the LM head).")
    ] = "input",
    include_special: Annotated[
        bool, typer.Option("--include-special", help="Search special tokens' rows too.")
    ] = False,
    pool: Annotated[
        str,
        typer.Option(
            "--pool",
            help="A word of several tokens: its first token's row, the mean of all its "
            "tokens' unit rows, or its last token's row (first, mean, last).",
        ),
    ] = "first",
    as_json: JsonOpt = False,
    revision: RevisionOpt = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "cpu",
    trust_remote_code: TrustOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Find the nearest tokens to each query by cosine in the embedding (or head) matrix.

    Only that one matrix is read (memory-mapped from safetensors, or dequantised from GGUF),
    and only real tokens' rows are searched: padding rows past the tokenizer's length never
    are, special tokens only with --include-special, and a query's own rows never appear.
    """
    from embedlens.errors import UsageError

    common(quiet=quiet, debug=debug, device=device)
    if k < 1:
        raise UsageError(f"-k must be at least 1 (got {k})")
    # The product is [block, d] x [d, queries] with few queries: BLAS threads cost more than they
    # give (0.73 s against 0.20 s for Qwen3-0.6B's table on two busy cores). Read when numpy is
    # first imported, just below; a value the user set wins.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from embedlens.analysis.neighbors import neighbors_report, resolve, searchable
    from embedlens.io.source import resolve as resolve_source
    from embedlens.model.matrix import check_matrix, locate, open_rows
    from embedlens.model.tokenizer import load_vocab
    from embedlens.model.words import check_pool

    which = check_matrix(matrix)
    check_pool(pool)
    with progress(f"Reading {model}"):
        source = resolve_source(model, revision)
        table = locate(source, which, trust_remote_code=trust_remote_code)
        vocab = load_vocab(source, table.checkpoint.gguf)
        real = min(vocab.size, table.rows)
        found = resolve(
            vocab, list(queries or []), list(ids or []), real=real, total=table.rows, pool=pool
        )
        allowed = searchable(vocab, real, include_special=include_special)
        searched = int(allowed.sum())
        if k > searched:
            raise UsageError(
                f"-k {k} is more than the {searched:,} rows searched",
                hint=f"use -k between 1 and {searched:,}",
            )
        notes = list(table.notes)
        if vocab.size > table.rows:
            notes.append(
                f"the tokenizer has {vocab.size:,} tokens but the matrix only {table.rows:,} "
                "rows: the tokens past them have no row"
            )
        rows = open_rows(source, table)
        report = neighbors_report(
            model,
            table,
            rows,
            vocab,
            found,
            allowed,
            k=k,
            include_special=include_special,
            notes=notes,
            pool=pool,
        )
    if dtype != "auto":
        note("note: neighbors computes in float32 from the stored rows; --dtype is not used")
    if device not in ("auto", "cpu"):
        note("note: neighbors runs on the CPU (one matrix product); --device is not used")
    for text in report.notes:
        note("note: " + text)
    emit(report, as_json=as_json)
