"""A tensor's rows as the format's own library reads them, and a row's bytes at its offset: what
`addr` checks embedlens' offsets against (safetensors' `safe_open`, gguf's `GGUFReader`).

numpy, gguf and safetensors are imported inside the functions.
"""

from __future__ import annotations

import inspect
import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from embedlens.errors import CheckpointError
from embedlens.io.checkpoint import TensorEntry
from embedlens.io.gguf import GGUF_CHECKED, GGUFHeader, LazyArray

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


_READER_SHAPES = {
    "_get_field_parts": ("self", "orig_offs", "raw_type"),
    "_get": ("self", "offset", "dtype", "count", "override_order"),
}
"""The parameters of the reader's own methods `_header_reader` uses, as those releases have
them."""


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
        reader = _header_reader(header) if _reader_fits() else _plain_reader(header)
        tensor = next(t for t in reader.tensors if t.name == name)
        return [np.asarray(tensor.data[r]).tobytes() for r in rows]
    except (ValueError, KeyError, IndexError, StopIteration, struct.error) as e:
        raise CheckpointError(
            f"gguf's reader disagrees with embedlens on '{header.path.name}': {e}"
        ) from e


def _reader_fits() -> bool:
    """Whether `_header_reader` may be used (see `gguf_reader_rows`)."""
    from embedlens.compat import checked_release, public_path

    fits = checked_release("gguf", *GGUF_CHECKED)
    if fits is None:
        return False
    why = None
    if not fits:
        why = "gguf's release is not one from 0.10 to 0.19"
    else:
        from gguf import GGUFReader

        for method, shape in _READER_SHAPES.items():
            try:
                params = tuple(inspect.signature(getattr(GGUFReader, method)).parameters)
            except (AttributeError, TypeError, ValueError):
                params = None
            if params != shape:
                why = f"gguf's GGUFReader.{method} is not as embedlens knows it"
                break
        if why is None and not isinstance(getattr(GGUFReader, "gguf_scalar_to_np", None), dict):
            why = "gguf's GGUFReader.gguf_scalar_to_np is not as embedlens knows it"
    if why is not None:
        public_path(f"gguf's reader reads the whole header to check the rows (slower): {why}")
    return why is None


def _plain_reader(header: GGUFHeader) -> Any:
    """gguf's GGUFReader on the header's file, as gguf has it."""
    from gguf import GGUFReader

    return GGUFReader(header.path)


def _header_reader(header: GGUFHeader) -> Any:
    """gguf's GGUFReader on the header's file, taking each long array whole."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType

    spans = {a.start: a.end for a in header.metadata.values() if isinstance(a, LazyArray)}

    class HeaderReader(GGUFReader):
        """GGUFReader that takes a long array whole instead of one item at a time."""

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            if raw_type != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            item, count = (
                int(x)
                for x in struct.unpack("<IQ", self.data[orig_offs : orig_offs + 12].tobytes())
            )
            parts = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
            types = [GGUFValueType.ARRAY, GGUFValueType(item)]
            start = orig_offs + 12  # past the array's item type and length
            if item == GGUFValueType.STRING and start in spans:
                return spans[start] - orig_offs, parts, [], types
            scalar = self.gguf_scalar_to_np.get(GGUFValueType(item))
            if scalar is None:
                return super()._get_field_parts(orig_offs, raw_type)
            parts.append(self._get(start, scalar, count))
            return int(sum(p.nbytes for p in parts)), parts, [2], types

    return HeaderReader(header.path)
