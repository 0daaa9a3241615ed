"""A tensor's rows as the format's own library reads them, and a row's bytes at its offset: what
`addr` checks embedlens' offsets against (safetensors' `safe_open`, gguf's `GGUFReader`).

numpy, gguf and safetensors are imported inside the functions.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from embedlens.compat.gguf import header_reader, plain_reader, reader_fits
from embedlens.errors import CheckpointError
from embedlens.io.checkpoint import TensorEntry
from embedlens.io.gguf import GGUFHeader, LazyArray

# Safetensors' numpy loader names these dtypes, which numpy itself lacks; their raw bits are
# compared instead, read as unsigned integers of the same width.
_RAW_ALIASES = {"bfloat16": "<u2", "float8_e4m3fn": "u1", "float8_e5m2": "u1"}


def raw_row(entry: TensorEntry, row: int) -> bytes:
    """The row's bytes read straight from the file at its absolute offset."""
    assert entry.path is not None and entry.file_offset is not None
    with open(entry.path, "rb") as fh:
        fh.seek(entry.file_offset - entry.base + row * entry.row_bytes)
        return fh.read(entry.row_bytes)


@contextmanager
def raw_dtype_names() -> Iterator[None]:
    """Let numpy resolve the dtype names safetensors uses for bf16 and fp8 (as raw bits)."""
    import numpy as np

    added = [n for n in _RAW_ALIASES if n not in np.sctypeDict]
    for name in added:
        np.sctypeDict[name] = np.dtype(_RAW_ALIASES[name]).type
    try:
        yield
    finally:
        for name in added:
            np.sctypeDict.pop(name, None)


def safetensors_rows(path: Path, name: str, rows: Sequence[int]) -> tuple[str, list[bytes]]:
    """Each row's bytes as safetensors' own loader loads the tensor (and the loader's name)."""
    from safetensors import SafetensorError, safe_open

    try:
        with raw_dtype_names(), safe_open(str(path), framework="numpy") as f:
            tensor_slice = f.get_slice(name)
            return "safetensors.safe_open(framework='numpy')", [
                tensor_slice[r : r + 1].tobytes() for r in rows
            ]
    except (SafetensorError, OSError, TypeError) as e:
        raise CheckpointError(f"safetensors cannot read '{name}' from '{path.name}': {e}") from e


def gguf_reader_rows(header: GGUFHeader, name: str, rows: Sequence[int]) -> list[bytes]:
    """The rows' bytes of tensor `name` as gguf's GGUFReader lays the file out. The reader walks
    the header itself (keys, values, tensor infos, alignment, data offset), except that it steps
    over each long string array (the vocabulary, the merges) by the span embedlens measured:
    decoding them is what makes it take seconds (a wrong span would derail its walk, not pass
    it), and takes each numeric array whole. That step leans on the reader's own methods: with
    EMBEDLENS_PLAIN=1, or (one note) on a gguf release or signature it was not checked against,
    the plain GGUFReader reads the whole header (seconds on a large vocabulary)."""
    import numpy as np

    try:
        spans = {a.start: a.end for a in header.metadata.values() if isinstance(a, LazyArray)}
        reader = header_reader(header.path, spans) if reader_fits() else plain_reader(header.path)
        tensor = next(t for t in reader.tensors if t.name == name)
        return [np.asarray(tensor.data[r]).tobytes() for r in rows]
    except (ValueError, KeyError, IndexError, StopIteration, struct.error) as e:
        raise CheckpointError(
            f"gguf's reader disagrees with embedlens on '{header.path.name}': {e}"
        ) from e
