"""The `addr` report: where a token's row lives, in the tensor, the file and across TP ranks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from embedlens.reports import Report


@dataclass(frozen=True)
class TpPlace:
    """Where a row lives under vocab-parallel tensor parallelism."""

    rank: int
    local_row: int
    local_offset_bytes: int
    """From the start of that rank's shard of the table."""


@dataclass(frozen=True)
class AddrRow:
    """One row's address."""

    row: int
    query: str
    """As given: the id or the token text."""
    token: str | None
    """The row's token text (None for a padding row)."""
    token_ids: list[int]
    """The whole encoding of a text query (the row is its first token); [row] for an id."""
    padding: bool
    """At or beyond the tokenizer's length: a row that belongs to no token."""
    offset_bytes: int
    """From the start of the tensor: row x row_bytes (= row x d x element size)."""
    file: str
    file_offset: int | None
    """From the start of the file (None when the file's header was read remotely)."""
    tp: TpPlace | None
    check: bool | None
    """The bytes at file_offset equal the row as the reference library loads it."""


@dataclass(frozen=True)
class TpSplit:
    """The vocab-parallel split of vLLM's VocabParallelEmbedding."""

    size: int
    pad_to: int
    padded_rows: int
    """V rounded up to a multiple of pad_to; each rank holds padded_rows / size rows."""
    rows_per_rank: int
    shard_bytes: int


@dataclass(frozen=True)
class Costs:
    """The seeds' arithmetic: a lookup reads a row, a one-hot product touches the whole table."""

    lookup_bytes_per_token: int
    onehot_ops_per_token: int
    """2 x V x d multiply-adds counted as two operations each (same as the LM head per position)."""
    tokens: int | None
    batch_bytes: int | None
    """Bytes a batch of `tokens` lookups reads at most (repeated ids read the same row)."""
    batch_onehot_ops: int | None


@dataclass(frozen=True)
class ReadCheck:
    """How the addresses were proven: bytes read at file_offset against a reference loader."""

    method: str | None
    rows_checked: int
    all_equal: bool | None
    skipped: str | None
    """Why no check ran, if none did."""


@dataclass(frozen=True)
class AddrReport(Report):
    """Row-address arithmetic for the embedding table (or the LM head)."""

    command: ClassVar[str] = "addr"
    model: str
    matrix: Literal["input", "output"]
    tensor: str
    format: str
    shape: list[int]
    dtype: str
    """As stored: 'bfloat16', 'float32', or a ggml type such as 'Q8_0'."""
    element_size: float | int
    """Bytes per element; fractional for quantised blocks (Q8_0: 34 / 32 = 1.0625)."""
    block: list[int] | None
    """A GGUF quantisation block: [elements, bytes]; None for plain element types."""
    stride: list[int]
    """Row-major strides in elements: a row is contiguous, a column is not."""
    row_bytes: int
    table_bytes: int
    file: str
    tensor_file_offset: int | None
    tokenizer_size: int | None
    rows: list[AddrRow]
    costs: Costs
    tp: TpSplit | None
    check: ReadCheck
    notes: list[str] = field(default_factory=list)
    hub_fetched_bytes: int | None = None
    """Bytes fetched from the hub by HTTP range for this report (headers and the rows read);
    None when nothing was read by range (a local model, or one whole in the hub cache)."""
