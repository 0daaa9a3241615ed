"""How the `addr` report is shown: the table's layout, one line per row, the read-back and the costs."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from embedlens.reports import register_view
from embedlens.reports.addr import AddrReport
from embedlens.text import model_title
from embedlens.views.format import Sheet, Words, count, shown, size


def _yes_no(value: bool | None) -> Text:
    if value is None:
        return Text("-", style="dim")
    return Text("equal" if value else "DIFFERENT", style="green" if value else "bold red")


def render(r: AddrReport) -> RenderableType:
    """The table's layout, one line per row, the check and the costs."""
    lines: list[RenderableType] = [_layout(r), _table(r), _read_back(r), Text(_costs(r))]
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


def _layout(r: AddrReport) -> Text:
    """The line on the tensor: file, shape, dtype, strides and sizes."""
    v, d = r.shape
    return shown(
        f"{r.tensor} in {model_title(r.file)}: shape [{count(v)}, {count(d)}], {r.dtype}, "
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


def _table(r: AddrReport) -> Sheet:
    """One line per row asked for: its token, offsets, tensor-parallel place and read-back."""
    table = Sheet()
    table.add_column("row", justify="right", no_wrap=True)
    table.add_column("token", min_width=7, no_wrap=True)
    table.add_column("tensor\noffset", justify="right", no_wrap=True)
    table.add_column("file\noffset", justify="right", no_wrap=True)
    if r.tp is not None:
        for col in ("TP\nrank", "local\nrow", "local\noffset"):
            table.add_column(col, justify="right", no_wrap=True)
    table.add_column("read\nback", no_wrap=True)
    for row in r.rows:
        token = (
            Words().token(row.token) if row.token is not None else Text("(padding)", style="dim")
        )
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
    return table


def _read_back(r: AddrReport) -> Text:
    """Whether the rows read at their file offsets equal the rows the model loads."""
    c = r.check
    if c.method is None:
        return shown(f"Read back: skipped ({c.skipped}).", style="dim")
    verdict = "equal" if c.all_equal else "NOT equal"
    return shown(
        f"Read back: {c.rows_checked} row(s) read at file_offset are {verdict} to the "
        f"rows loaded by {c.method}.",
        style="green" if c.all_equal else "bold red",
    )


def _costs(r: AddrReport) -> str:
    """What a lookup reads against what a one-hot product computes, per token and in all."""
    k = r.costs
    d = r.shape[1]
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
    return cost


register_view(AddrReport, render)
