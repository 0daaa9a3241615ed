"""`embedlens addr`: compute a row's address, then prove it by reading the row back."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

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
from embedlens.cli._output import count, emit, note, progress, quoted, shown, size
from embedlens.reports.addr import AddrReport

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
            help="A row id (an integer), or a token's text (its first token is used).",
            show_default=False,
        ),
    ],
    matrix: Annotated[
        str, typer.Option("--matrix", help="input (the embedding) or output (the LM head).")
    ] = "input",
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
            help="Read each row back from the file and compare it with the format's own loader.",
        ),
    ] = True,
    as_json: JsonOpt = False,
    revision: RevisionOpt = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "cpu",
    trust_remote_code: TrustOpt = False,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Compute where each row of the embedding table lives, then read it back to prove it.

    The arithmetic needs only the checkpoint's headers: shape, dtype, strides, the row's offset
    in the tensor and in the file, the cost of a lookup against a one-hot product, and with --tp
    the rank that holds the row. The check reads just those rows' bytes.
    """
    from embedlens.analysis.addr import addr_report, row_ids
    from embedlens.errors import UnsupportedError
    from embedlens.matrix import check_matrix, locate
    from embedlens.source import resolve
    from embedlens.vocab import Vocab, load_vocab

    common(quiet=quiet, debug=debug, dtype=dtype, device=device)
    which = check_matrix(matrix)
    with progress(f"Reading {model}"):
        source = resolve(model, revision)
        table = locate(source, which, trust_remote_code=trust_remote_code)
        notes = list(table.notes)
        vocab: Vocab | None
        ids = row_ids(rows)
        try:
            # Rows given as ids need only their own tokens, not the whole tokenizer.
            vocab = load_vocab(source, table.checkpoint.gguf, only=ids)
        except UnsupportedError as e:
            if ids is None:  # a row given as text cannot be read without the tokenizer
                raise
            vocab = None
            notes.append(f"tokens are not shown: {e.message}")
        report = addr_report(
            model, table, vocab, rows, tokens=tokens, tp=tp, check=check, notes=notes
        )
    for text in report.notes:
        note("note: " + text)
    emit(report, as_json=as_json, render=render_addr)


def _yes_no(value: bool | None) -> Text:
    if value is None:
        return Text("-", style="dim")
    return Text("equal" if value else "DIFFERENT", style="green" if value else "bold red")


def render_addr(r: AddrReport) -> RenderableType:
    """The table's layout, one line per row, the check and the costs."""
    v, d = r.shape
    layout = shown(
        f"{r.tensor} in {r.file}: shape [{count(v)}, {count(d)}], {r.dtype}, "
        f"{r.element_size} bytes per element, stride ({count(d)}, 1), "
        f"row {count(r.row_bytes)} bytes, table {count(r.table_bytes)} bytes "
        f"({size(r.table_bytes)})"
        + (
            f"; blocks of {r.block[0]} elements in {r.block[1]} bytes"
            if r.block is not None
            else ""
        )
        + (
            f"; tensor starts at byte {count(r.tensor_file_offset)}" if r.tensor_file_offset else ""
        ),
        style="bold",
    )
    table = Table()
    table.add_column("row", justify="right", no_wrap=True)
    table.add_column("token", min_width=7)
    table.add_column("tensor\noffset", justify="right", no_wrap=True)
    table.add_column("file\noffset", justify="right", no_wrap=True)
    if r.tp is not None:
        for col in ("TP\nrank", "local\nrow", "local\noffset"):
            table.add_column(col, justify="right", no_wrap=True)
    table.add_column("read\nback", no_wrap=True)
    for row in r.rows:
        token = quoted(row.token) if row.token is not None else Text("(padding)", style="dim")
        cells: list[Text | str] = [
            str(row.row),
            token,
            str(row.offset_bytes),
            "-" if row.file_offset is None else str(row.file_offset),
        ]
        if row.tp is not None:
            cells += [str(row.tp.rank), str(row.tp.local_row), str(row.tp.local_offset_bytes)]
        cells.append(_yes_no(row.check))
        table.add_row(*cells)
    lines: list[RenderableType] = [layout, table]
    c = r.check
    if c.method is not None:
        verdict = "equal" if c.all_equal else "NOT equal"
        lines.append(
            shown(
                f"Read back: {c.rows_checked} row(s) read at file_offset are {verdict} to the "
                f"rows loaded by {c.method}.",
                style="green" if c.all_equal else "bold red",
            )
        )
    else:
        lines.append(shown(f"Read back: skipped ({c.skipped}).", style="dim"))
    k = r.costs
    cost = (
        f"A lookup reads d x element size = {d} x {r.element_size} = "
        f"{count(k.lookup_bytes_per_token)} bytes per "
        f"token; a one-hot product would cost 2·V·d = {count(k.onehot_ops_per_token)} "
        "operations per token."
    )
    if k.tokens is not None and k.batch_bytes is not None and k.batch_onehot_ops is not None:
        cost += (
            f" {count(k.tokens)} tokens read at most {count(k.batch_bytes)} bytes "
            f"({size(k.batch_bytes)}), against {count(k.batch_onehot_ops)} one-hot operations."
        )
    lines.append(Text(cost))
    if r.tp is not None:
        t = r.tp
        lines.append(
            Text(
                f"--tp {t.size}: V padded to {count(t.padded_rows)} (a multiple of {t.pad_to}), "
                f"{count(t.rows_per_rank)} rows ({size(t.shard_bytes)}) per rank, as vLLM's "
                "VocabParallelEmbedding splits it."
            )
        )
    return Group(*lines)
