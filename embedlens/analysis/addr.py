"""Row addresses in the embedding table: in the tensor, in the checkpoint file, across TP ranks.

The arithmetic reads headers only. A row starts at row x row_bytes from the tensor's first byte;
row_bytes is d x element size for plain dtypes and d / block elements x block bytes for GGUF
quantised blocks. The proof reads the row's bytes at its file offset and compares them with the
row as the format's own library loads it (safetensors' `safe_open`); a GGUF row with the row's
bytes where gguf's own reader finds it, and with its values as gguf's dequantiser widens them.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from embedlens.analysis.hub_reads import counts_hub_reads
from embedlens.errors import UnsupportedError, UsageError
from embedlens.io.checkpoint import TORCH_DTYPE_NAMES, TensorEntry, fetch_gguf_rows, fetch_rows
from embedlens.io.gguf import GGUFHeader
from embedlens.io.reference import gguf_reader_rows, raw_row, safetensors_rows
from embedlens.io.source import ModelSource, resolve
from embedlens.model import words
from embedlens.model.gguf_words import words_vocab
from embedlens.model.matrix import Table, Which, check_matrix, check_row_range, locate
from embedlens.model.tokenizer import Vocab, load_vocab
from embedlens.reports.addr import AddrReport, AddrRow, Costs, ReadCheck, TpPlace, TpSplit

VLLM_PAD_TO = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
_ID = re.compile(r"^[+-]?\d+$")
_LOOKUP_SCALES = {
    "gemma": "sqrt(d)",
    "gemma2": "sqrt(d)",
    "gemma3": "sqrt(d)",
    "gemma3_text": "sqrt(d)",
    "granite": "embedding_multiplier",
    "granitemoe": "embedding_multiplier",
}


def row_bytes(table: Table) -> int:
    """Bytes of one row as stored (a packed table's: its packed values, scales apart)."""
    return table.entry.row_bytes if table.packed is None else table.packed.row_bytes


def element_size(entry: TensorEntry, table: Table | None = None) -> int | float:
    """Bytes per element as stored: row_bytes / d (fractional for quantised blocks)."""
    d = entry.shape[-1] if table is None else table.width
    size = (entry.row_bytes if table is None else row_bytes(table)) / d if d else 0.0
    return int(size) if float(size).is_integer() else size


def tp_split(rows: int, size: int, row_bytes: int) -> TpSplit:
    """vLLM's VocabParallelEmbedding: V padded to a multiple of 64, then cut into equal shards."""
    if size < 1:
        raise UsageError(f"--tp must be at least 1 (got {size})")
    padded = -(-rows // VLLM_PAD_TO) * VLLM_PAD_TO
    if padded % size:
        raise UsageError(
            f"--tp {size} does not divide the padded vocabulary: V = {rows:,} rounds up to "
            f"{padded:,} (a multiple of {VLLM_PAD_TO}), which vLLM splits into equal shards",
            hint="use a tensor-parallel size that divides " + f"{padded:,}",
        )
    per = padded // size
    return TpSplit(size, VLLM_PAD_TO, padded, per, per * row_bytes)


def tp_place(row: int, split: TpSplit, row_bytes: int) -> TpPlace:
    """The rank holding a row and its place in that rank's shard."""
    rank, local = divmod(row, split.rows_per_rank)
    return TpPlace(rank, local, local * row_bytes)


def costs(rows: int, width: int, row_bytes: int, tokens: int | None) -> Costs:
    """Bytes a lookup reads against the operations of a one-hot product, per token and batch."""
    if tokens is not None and tokens < 1:
        raise UsageError(f"--tokens must be at least 1 (got {tokens})")
    onehot = 2 * rows * width
    return Costs(
        lookup_bytes_per_token=row_bytes,
        onehot_ops_per_token=onehot,
        tokens=tokens,
        batch_bytes=None if tokens is None else tokens * row_bytes,
        batch_onehot_ops=None if tokens is None else tokens * onehot,
    )


def row_ids(given: Sequence[str]) -> list[int] | None:
    """The rows as ids when every ROW is one; None when a ROW is a token's text."""
    if not given or not all(_ID.match(text.strip()) for text in given):
        return None
    return [int(text) for text in given]


def resolve_rows(
    given: Sequence[str], vocab: Vocab | None, total: int
) -> list[tuple[str, int, list[int]]]:
    """(the row's query, row, whole encoding) for each ROW: an id, or a token's text (a text
    wholly inside one pair of quotes is the text between them: "' king'" is ' king')."""
    out: list[tuple[str, int, list[int]]] = []
    for text in given:
        if text == "":
            raise UsageError("empty ROW", hint="give a row id or a token's text")
        if _ID.match(text.strip()):
            row = int(text)
            check_row_range(row, total, "table")
            out.append((text, row, [row]))
            continue
        if vocab is None:
            raise UsageError(f"'{text}' is not a row id, and the model has no tokenizer to read it")
        text = words.unquoted(text)
        ids = vocab.encode(text)
        if len(ids) != 1 and vocab.lookup(text) is not None:
            ids = [vocab.lookup(text) or 0]
        if not ids:
            raise UsageError(f"'{text}' encodes to no tokens", hint="give a row id instead")
        if vocab.unk_id is not None and ids[0] == vocab.unk_id and vocab.lookup(text) is None:
            raise UsageError(
                f"'{text}' is not in the vocabulary: it encodes to the unknown token",
                hint="give a row id instead",
            )
        if ids[0] >= total:
            raise UsageError(f"'{text}' is token {ids[0]}, beyond the table's {total:,} rows")
        out.append((text, ids[0], ids))
    if not out:
        raise UsageError("no ROW given", hint="give a row id or a token's text")
    return out


def gguf_check(
    entry: TensorEntry, rows: Sequence[int], header: GGUFHeader
) -> tuple[str, list[bool]]:
    """Each GGUF row as gguf's own reader places it (io.reference.gguf_reader_rows) and gguf's
    dequantiser widens it, against the row's bytes read at embedlens' file offset and the row as
    embedlens' memory-mapped reader (matrix.Rows, what `neighbors` reads) widens it."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from embedlens.model.matrix import Rows

    try:
        qtype = GGMLQuantizationType[entry.dtype]
    except KeyError as e:
        raise UnsupportedError(f"gguf cannot dequantise ggml type {entry.dtype}") from e
    theirs = gguf_reader_rows(header, entry.name, rows)
    mapped = Rows(entry, "gguf").take(list(rows))
    results = []
    for r, ref, mine in zip(rows, theirs, mapped, strict=True):
        widened = np.asarray(dequantize(np.frombuffer(ref, np.uint8), qtype), dtype=np.float32)
        same = raw_row(entry, r) == ref
        results.append(same and bool(np.array_equal(widened.reshape(-1), mine, equal_nan=True)))
    return "gguf.GGUFReader + gguf.quants.dequantize", results


def _read_back(
    table: Table, rows: list[int], *, check: bool, source: ModelSource | None = None
) -> tuple[str | None, str | None, list[bool | None]]:
    """(method, why skipped, per-row result) of reading the rows back from the file."""
    entry = table.entry
    if not check:
        return None, "--no-check", [None] * len(rows)
    if entry.path is None or entry.file_offset is None:
        why = f"'{entry.file}' is not downloaded: its header was read from the hub"
        return None, why, [None] * len(rows)
    if table.packed is not None:
        from embedlens.analysis import addr_packed

        assert source is not None
        return (
            addr_packed.method(table.packed),
            None,
            list(addr_packed.packed_check(table, rows, source)),
        )
    if table.checkpoint.format == "gguf":
        assert table.checkpoint.gguf is not None
        method, checks = gguf_check(entry, rows, table.checkpoint.gguf)
        return method, None, list(checks)
    method, refs = safetensors_rows(entry.path, entry.name, rows)
    return method, None, [raw_row(entry, r) == ref for r, ref in zip(rows, refs, strict=True)]


@contextmanager
def _rows_on_disk(table: Table, rows: list[int], source: ModelSource | None) -> Iterator[Table]:
    """The table, or for a hub file the hub cache lacks, a table whose file is a sparse copy
    (header and the rows' byte ranges, fetched or kept) in a temporary folder."""
    entry = table.entry
    if source is not None and source.remote and entry.path is None:
        path = fetch_gguf_rows(source, entry, rows)  # the header's copy, with the rows
        yield replace(table, entry=replace(entry, path=path, base=0))
        return
    if source is None or source.kind != "hub" or entry.path is not None or table.packed:
        yield table
        return
    if entry.file_offset is None or table.checkpoint.format != "safetensors":
        yield table
        return
    with tempfile.TemporaryDirectory(prefix="embedlens-rows-") as folder:
        path = fetch_rows(source, entry, rows, Path(folder))
        yield replace(table, entry=replace(entry, path=path, base=0))


def _layout_notes(table: Table, vocab: Vocab | None, real: int, rows: list[AddrRow]) -> list[str]:
    """What the layout alone does not say: a scaled lookup, padding rows."""
    notes = []
    scale = _LOOKUP_SCALES.get(str(table.config.model_type))
    if scale is not None:
        notes.append(
            f"{table.config.model_type} multiplies the looked-up row by {scale}: the layer's "
            "output is not the stored row"
        )
    if any(r.padding for r in rows) and vocab is not None:
        notes.append(f"rows from {real:,} on are padding: the tokenizer has {vocab.size:,} tokens")
    if table.packed is not None:
        from embedlens.analysis.addr_packed import scale_notes

        notes += scale_notes(table, [r.row for r in rows])
    return notes


def _dtype(table: Table) -> str:
    """The table's dtype as `addr` names it: ggml's type, a packing, or torch's name."""
    dtype = table.entry.dtype
    if table.checkpoint.format == "gguf":
        return dtype
    return table.packed.label if table.packed is not None else TORCH_DTYPE_NAMES.get(dtype, dtype)


def _rows(
    table: Table,
    vocab: Vocab | None,
    found: list[tuple[str, int, list[int]]],
    results: list[bool | None],
    real: int,
    split: TpSplit | None,
) -> list[AddrRow]:
    """One line per row asked for: its token, offsets, tensor-parallel place and read-back."""
    entry, size = table.entry, row_bytes(table)
    return [
        AddrRow(
            row=r,
            query=text,
            token=vocab.text(r) if vocab is not None and r < real else None,
            token_ids=ids,
            padding=r >= real,
            offset_bytes=r * size,
            file=entry.file,
            file_offset=None if entry.file_offset is None else entry.file_offset + r * size,
            tp=None if split is None else tp_place(r, split, size),
            check=ok,
        )
        for (text, r, ids), ok in zip(found, results, strict=True)
    ]


def addr_report(
    model: str,
    table: Table,
    vocab: Vocab | None,
    given: Sequence[str],
    *,
    tokens: int | None,
    tp: int | None,
    check: bool,
    notes: list[str],
    source: ModelSource | None = None,
) -> AddrReport:
    """Addresses of the given rows, the table's layout and costs, and the read-back proof
    (source: where a hub table's rows are fetched from when its file is not on disk)."""
    entry = table.entry
    v, d = table.rows, table.width
    found = resolve_rows(given, vocab, v)
    for typed, (text, _, ids) in zip(given, found, strict=True):
        if vocab is not None and not _ID.match(typed.strip()):  # a word: how it split
            notes += words.word_notes(text, ids, vocab.encode, vocab.text, verb="addressed")
            how = "give its id, {id}"
            literal = words.literal_note(typed, vocab.encode, vocab.text, how)
            notes += [] if literal is None else [literal]
    size = row_bytes(table)
    split = None if tp is None else tp_split(v, tp, size)
    cost = costs(v, d, size, tokens)
    real = min(vocab.size, v) if vocab is not None else v
    wanted = [r for _, r, _ in found]
    with _rows_on_disk(table, wanted, source if check else None) as placed:
        method, skipped, results = _read_back(placed, wanted, check=check, source=source)
    rows = _rows(table, vocab, found, results, real, split)
    checked = [ok for ok in results if ok is not None]
    notes += _layout_notes(table, vocab, real, rows)
    return AddrReport(
        model=model,
        matrix=table.which,
        tensor=entry.name,
        format=table.checkpoint.format,
        shape=[v, d],
        dtype=_dtype(table),
        element_size=element_size(entry, table),
        block=list(entry.block) if entry.block is not None else None,
        stride=[d, 1],
        row_bytes=size,
        table_bytes=entry.nbytes,
        file=entry.file,
        tensor_file_offset=entry.file_offset,
        tokenizer_size=vocab.size if vocab is not None else None,
        rows=rows,
        costs=cost,
        tp=split,
        check=ReadCheck(
            method=method,
            rows_checked=len(checked),
            all_equal=all(checked) if checked else None,
            skipped=skipped,
        ),
        notes=notes,
    )


def addr(
    model: str | os.PathLike[str],
    rows: int | str | Sequence[int | str],
    *,
    matrix: Which = "input",
    tokens: int | None = None,
    tp: int | None = None,
    check: bool = True,
    revision: str | None = None,
) -> AddrReport:
    """Where each row of the embedding (or head) table lives, proved by reading it back.

    rows: row ids, or tokens' texts (a text's first token is used; one wholly inside a pair of
    quotes is the text between them); tokens: also give the bytes
    a batch of that many lookups reads; tp: the tensor-parallel size (which rank holds each row,
    as vLLM splits the table); check: read each row back and compare it with the format's own
    loader.
    """
    which = check_matrix(matrix)
    given = [rows] if isinstance(rows, int | str) else list(rows)
    spec = os.fspath(model)
    return _addr(spec, given, which, tokens, tp, check, revision)


@counts_hub_reads
def _addr(
    spec: str,
    given: list[int | str],
    which: Which,
    tokens: int | None,
    tp: int | None,
    check: bool,
    revision: str | None,
) -> AddrReport:
    source = resolve(spec, revision)
    table = locate(source, which)
    notes = list(table.notes)
    texts = [str(r) for r in given]
    ids = row_ids(texts)
    vocab: Vocab | None
    try:
        # Rows given as ids need only their own tokens, words only the pieces they can be
        # built from: neither the whole tokenizer.
        gguf = table.checkpoint.gguf
        vocab = words_vocab(source, gguf) if ids is None else load_vocab(source, gguf, only=ids)
    except UnsupportedError as e:
        if ids is None:  # a row given as text cannot be read without the tokenizer
            raise
        vocab = None
        notes.append(f"tokens are not shown: {e.message}")
    return addr_report(
        spec, table, vocab, texts, tokens=tokens, tp=tp, check=check, notes=notes, source=source
    )
