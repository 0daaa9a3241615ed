"""`addr` on a table stored quantised (MLX, bitsandbytes): a packed row's bytes, the bytes of the
scales that go with it, and its read-back check.

The check reads the packed row's bytes at embedlens' file offset and compares them with the
packed tensor's row as safetensors' own loader loads it; then the row as embedlens' memory-mapped
reader dequantises it (what `neighbors` reads) against the same formula applied to the bytes and
scales safetensors loads. No format library is involved: the values are checked against
embedlens' transcription of the format's formula (tests check that transcription against
bitsandbytes' own dequantiser, and against MLX's formula written out independently).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from embedlens.errors import CheckpointError
from embedlens.io.checkpoint import TensorEntry
from embedlens.model.matrix import PackedRows, Table, on_disk
from embedlens.model.packed_rows import Packed

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from embedlens.io.source import ModelSource

METHOD = (
    "safetensors.safe_open(framework='numpy') on the packed row and its scales, dequantised by "
    "embedlens' transcription of {formula}"
)
_FORMULAS = {
    "mlx": "mlx.core.dequantize",
    "int8": "bitsandbytes' int8_vectorwise_dequant",
}


def method(packed: Packed) -> str:
    """What the read-back compares a packed row with."""
    return METHOD.format(formula=_FORMULAS.get(packed.kind, "bitsandbytes' dequantize_4bit"))


def scale_notes(table: Table, rows: list[int]) -> list[str]:
    """Where the bookkeeping each row needs lies (tensor, bytes from its start, file offset)."""
    packed = table.packed
    assert packed is not None
    notes = []
    for r in rows:
        where = []
        for name, start, size in packed.part_ranges(r):
            entry = table.checkpoint.tensors[name]
            at = "" if entry.file_offset is None else f", file offset {entry.file_offset + start:,}"
            where.append(f"'{name}' bytes {start:,} to {start + size:,}{at}")
        notes.append(f"row {r} is scaled by " + "; ".join(where))
    return notes


def _loaded(path: Any, name: str) -> npt.NDArray[Any]:
    """A tensor as safetensors' numpy loader loads it (bfloat16 as its raw 16 bits)."""
    import numpy as np
    from safetensors import SafetensorError, safe_open

    from embedlens.io.reference import raw_dtype_names

    try:
        with raw_dtype_names(), safe_open(str(path), framework="numpy") as f:
            return np.asarray(f.get_tensor(name))
    except (SafetensorError, OSError, TypeError) as e:
        raise CheckpointError(f"safetensors cannot read '{name}': {e}") from e


def packed_check(table: Table, rows: list[int], source: ModelSource) -> list[bool]:
    """Each packed row: its bytes at embedlens' offset equal safetensors' row, and its values
    as embedlens' reader dequantises them equal the formula on what safetensors loads."""
    import numpy as np

    from embedlens.model import packed_rows as pr

    packed = table.packed
    assert packed is not None and table.entry.path is not None
    assert table.entry.file_offset is not None
    reader = PackedRows(packed, source)
    mine = reader.take(rows)
    weight = _loaded(table.entry.path, packed.weight.name)
    stored = np.ascontiguousarray(weight).view(np.uint8).reshape(packed.shape[0], -1)
    parts = {r: _part(t, source) for r, t in packed.parts.items()}
    ids = np.asarray(rows, dtype=np.int64)
    v, d = packed.shape
    if packed.kind == "mlx":
        groups = d // packed.group
        s, b = (parts[k].reshape(v, groups)[ids] for k in ("scales", "biases"))
        theirs = pr.mlx_values(stored[ids].view(np.uint32), s, b, packed.bits, packed.group)
    elif packed.kind == "int8":
        w = stored[ids].view(np.int8).astype(np.float32)
        theirs = (w * parts["SCB"][ids][:, None]) * np.float32(pr.INT8_SCALE)
    else:
        absmax = reader._absmax  # the nested statistics undone as the reader does
        dtype = str(packed.state.get("dtype", "float32"))
        theirs = pr.bnb_4bit_values(
            stored[ids], parts["quant_map"], absmax, ids * d, packed.group, dtype
        )
    out = []
    start = table.entry.file_offset - table.entry.base
    with open(table.entry.path, "rb") as fh:
        for k, r in enumerate(rows):
            fh.seek(start + r * packed.row_bytes)
            same = fh.read(packed.row_bytes) == stored[r].tobytes()
            out.append(same and bool(np.array_equal(mine[k], theirs[k], equal_nan=True)))
    return out


def _part(entry: TensorEntry, source: ModelSource) -> npt.NDArray[np.float32]:
    """A scaling tensor's values as float32, loaded by safetensors (bfloat16 widened)."""
    import numpy as np

    placed = on_disk(source, entry)
    values = _loaded(placed.path, entry.name).reshape(-1)
    if entry.dtype == "BF16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    return np.asarray(values, dtype=np.float32)
