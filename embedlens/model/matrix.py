"""One matrix out of a checkpoint, without torch: the embedding table or the LM head.

`locate` finds the tensor from the headers alone (no weights read). `open_rows` then maps just that
tensor: a numpy memory map over the safetensors data in its stored dtype (bfloat16 widened to
float32 block by block), or over a GGUF tensor's quantised blocks, dequantised by the `gguf`
package block by block. A hub file that is not in the hub cache has only the tensor's byte range
fetched (embedlens.io.ranges).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from embedlens.errors import CheckpointError, UnsupportedError, UsageError
from embedlens.io.checkpoint import (
    Checkpoint,
    TensorEntry,
    fetch_tensor,
    offline_error,
    open_checkpoint,
    read_safetensors_header,
)
from embedlens.io.hub import hub_offline
from embedlens.io.source import WEIGHT_SINGLE, ModelSource
from embedlens.model import q6_k
from embedlens.model.files import ModelConfig, check_integer_weights, quant_settings, read_config
from embedlens.model.inventory import from_checkpoint
from embedlens.model.packed_rows import (
    FLOATS,
    INT8_SCALE,
    Packed,
    bnb_4bit_values,
    find_packed,
    mlx_values,
)

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt


Which = Literal["input", "output"]
MATRICES: tuple[str, ...] = ("input", "output")

# Stored safetensors dtypes read as numpy arrays (BF16 as its raw 16 bits, widened on the fly).
_SAFETENSORS_NUMPY = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "BF16": "<u2"}
# Float32 bytes per block: small enough to stay in cache between widening and the product
# (2 MiB blocks score Qwen3-0.6B's table three times faster than 32 MiB ones); GGUF blocks are
# larger because each dequantize() call has a fixed cost.
_BLOCK_BYTES = 2 << 20
_GGUF_BLOCK_BYTES = 16 << 20
_PASS_BYTES = 1 << 20
_PIECE_BYTES = 1 << 20  # float32 bytes of a K-quant (or other gguf-read type) dequantised at a call
_Q6_K_PIECE_BYTES = 2 << 20
"""Q6_K's (unpacked here): a pass's piece (`undertrained.PIECE_VALUES`) in one call. On two
cores a pass over the 262k x 1024 bench table took 0.21 s so, 0.24 to 0.32 s in 1 MiB."""
_Q8_0 = (32, 34)  # elements and bytes of a Q8_0 block: a float16 scale and 32 int8 values
Dequantize = Callable[..., "npt.NDArray[np.float32]"]
"""(raw rows, width, out buffer or None) -> float32 rows: a ggml type's formula."""


@dataclass(frozen=True)
class Table:
    """The matrix a command works on, as the headers describe it."""

    which: Which
    entry: TensorEntry
    tied: bool
    """The model's head is its embedding matrix."""
    checkpoint: Checkpoint
    config: ModelConfig
    notes: tuple[str, ...] = ()
    packed: Packed | None = None
    """Where the table is stored quantised (MLX, bitsandbytes): its packing, read by
    `packed_rows`; `entry` is then the packed tensor."""
    name: str = field(init=False, compare=False, repr=False)
    """The tensor's name in the checkpoint."""
    rows: int = field(init=False, compare=False, repr=False)
    """V: the number of rows."""
    width: int = field(init=False, compare=False, repr=False)
    """d: the length of a row."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", self.entry.name)
        shape = self.entry.shape if self.packed is None else self.packed.shape
        object.__setattr__(self, "rows", shape[0])
        object.__setattr__(self, "width", shape[-1])


def check_row_range(row: int, total: int, noun: str = "matrix") -> None:
    """UsageError for a row that is negative or past the last of `total` rows."""
    if row < 0:
        raise UsageError(f"row {row} is negative", hint=f"rows run from 0 to {total - 1}")
    if row >= total:
        raise UsageError(
            f"row {row} is out of range: the {noun} has {total:,} rows",
            hint=f"rows run from 0 to {total - 1}",
        )


def check_matrix(which: str) -> Which:
    """Validate --matrix."""
    if which not in MATRICES:
        raise UsageError(f"unknown matrix '{which}'", hint="use --matrix input or --matrix output")
    return "input" if which == "input" else "output"


def locate(source: ModelSource, which: Which = "input") -> Table:
    """Find the embedding (or the head) from the checkpoint's headers; no weights are read.

    No model code runs here, so a config whose model needs the repository's code is read too."""
    ckpt = open_checkpoint(source, partial=True)
    if ckpt is None and source.kind == "hub" and hub_offline():
        raise offline_error(source, WEIGHT_SINGLE)  # not in either cache: which, unknown offline
    if ckpt is None:
        raise CheckpointError(
            f"'{source.spec}' has no safetensors or GGUF weights",
            hint="embedlens reads the table straight from safetensors or GGUF files",
        )
    config = (
        read_config(source, ckpt)
        if source.is_gguf
        else read_config(source, trust_remote_code=True)  # read only: no code is imported
    )
    inv = from_checkpoint(ckpt, config)
    assert inv.embedding is not None
    notes: list[str] = []
    name = inv.embedding
    if which == "output":
        if inv.head is not None:
            name = inv.head
        else:
            notes.append(
                "the LM head is tied to the embedding: the output matrix is the input matrix"
            )
    if name in ckpt.unread:
        raise offline_error(source, ckpt.unread[name])
    if name in inv.packed:
        packed = find_packed(ckpt, quant_settings(config), name) if name in ckpt.tensors else None
        if packed is None:
            label = next(i.dtype for i in inv.items if i.name == name)
            raise UnsupportedError(
                f"'{name}' is stored quantised ({label}); embedlens reads its rows only where "
                "it can dequantise them (GGUF, MLX, bitsandbytes)",
                hint="use the unquantised checkpoint the quantisation was made from; "
                "`embedlens params` counts this one",
            )
        return Table(which, packed.weight, inv.tied, ckpt, config, tuple(notes), packed)
    entry = ckpt.tensors[name]
    if len(entry.shape) != 2:
        raise CheckpointError(f"'{name}' has shape {list(entry.shape)}, not [V, d]")
    return Table(which, entry, inv.tied, ckpt, config, tuple(notes))


def stored_rows(table: Table, name: str) -> int:
    """Rows of tensor `name` of the table's checkpoint as the model holds them (a table packed
    by MLX or bitsandbytes: its unpacked rows)."""
    entry = table.checkpoint.tensors[name]
    if table.packed is not None and table.packed.weight.name == name:
        return table.packed.shape[0]
    if entry.dtype in ("U32", "I8", "U8"):
        packed = find_packed(table.checkpoint, quant_settings(table.config), name)
        if packed is not None:
            return packed.shape[0]
    return entry.shape[0]


def on_disk(source: ModelSource, entry: TensorEntry) -> TensorEntry:
    """The entry with its bytes on disk and its absolute offset: a hub file that the hub cache
    lacks has the tensor's byte range fetched (or read from the kept ranges)."""
    if entry.path is not None and entry.file_offset is not None:
        return entry
    remote = source.remote or (source.kind == "hub" and source.cached(entry.file) is None)
    if remote and entry.file_offset is not None:
        return fetch_tensor(source, entry)
    path = source.file(entry.file)
    header = read_safetensors_header(path, entry.file)
    found = header.tensors.get(entry.name)
    if found is None:
        raise CheckpointError(f"shard '{entry.file}' does not hold '{entry.name}'")
    return replace(found, path=path)


class Rows:
    """Float32 rows of one [V, d] tensor, read block by block from a memory map."""

    def __init__(self, entry: TensorEntry, fmt: str) -> None:
        import numpy as np

        if entry.path is None or entry.file_offset is None:
            raise CheckpointError(f"'{entry.name}' is not on disk")
        self.entry = entry
        self.shape = (entry.shape[0], entry.shape[-1])
        v, d = self.shape
        self._gguf = fmt == "gguf"
        self._dequantize: Dequantize | None = None
        mapped: np.memmap[Any, Any]
        if self._gguf:
            if not self._q8_0:  # Q8_0 and Q6_K are read here, without importing gguf (0.1 s)
                self._dequantize = _dequantizer(entry.dtype, entry.block)
            mapped = np.memmap(
                entry.path,
                np.uint8,
                "r",
                offset=entry.file_offset - entry.base,
                shape=(v, entry.row_bytes),
            )
        else:
            np_dtype = _SAFETENSORS_NUMPY.get(entry.dtype)
            if np_dtype is None:
                raise UnsupportedError(
                    f"'{entry.name}' is stored as {entry.dtype}; embedlens reads F32, F16, BF16 "
                    "and F64 tables"
                )
            mapped = np.memmap(
                entry.path,
                np.dtype(np_dtype),
                "r",
                offset=entry.file_offset - entry.base,
                shape=(v, d),
            )
        # The map read as a plain array: each block sliced from a np.memmap runs its Python
        # hooks through every view the conversion takes (a tenth of a Q8_0 pass); the array
        # keeps the map open.
        self._map: npt.NDArray[Any] = np.asarray(mapped)
        block_bytes = _GGUF_BLOCK_BYTES if fmt == "gguf" else _BLOCK_BYTES
        self.block_rows = max(1, block_bytes // (4 * d))
        self._buffer: npt.NDArray[np.uint32] | None = None

    @property
    def pass_rows(self) -> int:
        """Rows per block for a pass that multiplies each block by a few vectors: 1 MiB of
        float32 stays in cache and its product runs on one BLAS thread (larger ones start
        threads that wait on each other when the cores are busy: four times the CPU time);
        other GGUF types (read through gguf's formulas, in pieces of their own) keep the larger
        blocks their passes have always summed, so their figures stay the same."""
        if self._gguf and not self._q8_0:
            return self.block_rows
        return max(1, _PASS_BYTES // (4 * self.shape[1]))

    @property
    def _q8_0(self) -> bool:
        return self.entry.dtype == "Q8_0" and self.entry.block == _Q8_0

    def _convert(
        self, raw: npt.NDArray[np.generic], out: npt.NDArray[np.uint32] | None = None
    ) -> npt.NDArray[np.float32]:
        import numpy as np

        if self._gguf and self._q8_0:
            return _dequantize_q8_0(raw, self.shape[1], out)
        if self._dequantize is not None:
            piece = _Q6_K_PIECE_BYTES if self.entry.dtype == "Q6_K" else _PIECE_BYTES
            return _in_pieces(self._dequantize, raw, self.shape[1], out, piece)
        if self.entry.dtype == "F32":
            return np.asarray(raw, dtype=np.float32)
        if out is None:
            out = np.empty(raw.shape, dtype=np.uint32)
        if self.entry.dtype == "BF16":  # bfloat16 is the top half of a float32
            np.left_shift(raw, 16, out=out, dtype=np.uint32)
            return out.view(np.float32)
        widened = out.view(np.float32)
        np.copyto(widened, raw, casting="same_kind")
        return widened

    def block(self, start: int, stop: int) -> npt.NDArray[np.float32]:
        """Rows start..stop-1 as float32, in a buffer reused by the next call."""
        import numpy as np

        raw = self._map[start:stop]
        if self._buffer is None or self._buffer.shape[0] < raw.shape[0]:
            self._buffer = np.empty((max(raw.shape[0], self.block_rows), self.shape[1]), np.uint32)
        return self._convert(raw, self._buffer[: raw.shape[0]])

    def block_into(
        self, start: int, stop: int, out: npt.NDArray[np.float32]
    ) -> npt.NDArray[np.float32]:
        """Rows start..stop-1 as float32, written into `out` (C-contiguous, [stop - start, d]);
        returns `out`."""
        import numpy as np

        got = self._convert(self._map[start:stop], out.view(np.uint32))
        if not np.shares_memory(got, out):  # float32 rows are read where they lie
            out[...] = got
        return out

    def twin(self) -> Rows:
        """The same rows with a block buffer of their own (one per thread reading them)."""
        import copy

        other = copy.copy(self)
        other._buffer = None
        return other

    def take(self, ids: list[int]) -> npt.NDArray[np.float32]:
        """The given rows as float32, in order (a new array)."""
        import numpy as np

        raw: npt.NDArray[np.generic] = self._map[np.asarray(ids, dtype=np.int64)]
        return self._convert(raw)  # a new array: every conversion writes a fresh one


def _dequantize_q8_0(
    raw: npt.NDArray[np.generic], width: int, out: npt.NDArray[np.uint32] | None
) -> npt.NDArray[np.float32]:
    """Q8_0 rows as float32 in one vectorised product (each block of 32 int8 values times its
    float16 scale), into `out` when given: what gguf's dequantize gives, without its per-group
    Python calls. One multiply reads the int8 values where they lie, converting them to float32
    on the way (exact; a fifth faster than copying them out and converting them first)."""
    import numpy as np

    n, groups = raw.shape[0], width // 32
    stored = np.ascontiguousarray(raw).view(np.uint8).reshape(n, groups, 34)
    scales = stored.view(np.uint16)[:, :, 0].view(np.float16).astype(np.float32)
    result = np.empty((n, width), np.float32) if out is None else out.view(np.float32)
    grouped = result.reshape(n, groups, 32)
    values = stored[:, :, 2:].view(np.int8)
    np.multiply(values, scales[:, :, None], out=grouped, dtype=np.float32)
    return result


def _dequantizer(dtype: str, block: tuple[int, int] | None) -> Dequantize:
    """The `gguf` package's formula for a ggml type, taking rows of its blocks: Q6_K's in numpy
    here (`q6_k.py`, the same values, unpacked faster), else the type's own class called on the
    rows given (gguf's dequantize() splits them into calls of 16 rows each, a fixed cost a
    call)."""
    if dtype == "Q6_K" and block == q6_k.BLOCK:
        return q6_k.dequantize_q6_k
    import gguf
    from gguf import quants

    try:
        qtype = gguf.GGMLQuantizationType[dtype]
    except KeyError as e:
        raise UnsupportedError(f"gguf cannot read ggml type {dtype}") from e
    own: Any = getattr(quants, dtype, None)
    if getattr(own, "qtype", None) == qtype and hasattr(own, "dequantize_rows"):
        own.init_grid()  # what dequantize() does first (the grid types' lookup tables)
        return lambda raw, width, out: _into(own.dequantize_rows(raw), width, out)
    return lambda raw, width, out: _into(quants.dequantize(raw, qtype), width, out)


def _into(
    values: npt.NDArray[np.generic], width: int, out: npt.NDArray[np.uint32] | None
) -> npt.NDArray[np.float32]:
    """gguf's values as float32 rows of `width`, copied into `out` when given."""
    import numpy as np

    rows = np.asarray(values, dtype=np.float32).reshape(-1, width)
    if out is None:
        return rows
    result = out.view(np.float32)
    result[...] = rows
    return result


def _in_pieces(
    dequantize: Dequantize,
    raw: npt.NDArray[np.generic],
    width: int,
    out: npt.NDArray[np.uint32] | None,
    piece: int = _PIECE_BYTES,
) -> npt.NDArray[np.float32]:
    """Rows dequantised `piece` bytes of float32 at a call (the formulas' temporaries stay in
    cache), into `out` when given; each value is what one call on all the rows gives (the
    formulas work block by block)."""
    import numpy as np

    n = raw.shape[0]
    result = np.empty((n, width), np.float32) if out is None else out.view(np.float32)
    step = max(1, piece // (4 * width))
    for start in range(0, n, step):
        rows = np.ascontiguousarray(raw[start : start + step]).view(np.uint8)
        dequantize(rows, width, result[start : start + step])
    return result


def open_rows(source: ModelSource, table: Table) -> Rows:
    """Map the table's tensor (for a hub repo, fetching its byte range alone); a packed one is
    dequantised as it is read (`packed_rows`)."""
    if table.packed is not None:
        return PackedRows(table.packed, source)
    check_integer_weights(table.checkpoint, table.config, [table.entry.name])
    entry = on_disk(source, table.entry)
    return Rows(entry, table.checkpoint.format)


def _floats(entry: TensorEntry, source: ModelSource) -> npt.NDArray[np.float32]:
    """A small tensor's values as float32 (F32, F16, BF16, F64, or raw U8)."""
    import numpy as np

    placed = on_disk(source, entry)
    assert placed.path is not None and placed.file_offset is not None
    with open(placed.path, "rb") as fh:
        fh.seek(placed.file_offset - placed.base)
        raw = fh.read(placed.nbytes)
    if len(raw) != placed.nbytes:
        raise CheckpointError(f"'{entry.name}' is cut short in '{entry.file}'")
    if entry.dtype == "BF16":
        return (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
    if entry.dtype == "U8":
        return np.frombuffer(raw, np.uint8).astype(np.float32)
    dtype = FLOATS.get(entry.dtype)
    if dtype is None:
        raise CheckpointError(f"'{entry.name}' is stored as {entry.dtype}, not a float type")
    return np.frombuffer(raw, dtype).astype(np.float32)


class PackedRows(Rows):
    """Float32 rows of a packed table, dequantised block by block from a memory map."""

    def __init__(self, packed: Packed, source: ModelSource) -> None:
        import numpy as np

        weight = on_disk(source, packed.weight)
        assert weight.path is not None and weight.file_offset is not None
        self.entry = weight
        self.packed = packed
        self.shape = packed.shape
        v, d = packed.shape
        self._gguf = False
        self._dequantize = None
        word = np.uint32 if packed.kind == "mlx" else np.uint8
        per_row = packed.row_bytes // np.dtype(word).itemsize
        mapped = np.memmap(
            weight.path, word, "r", offset=weight.file_offset - weight.base, shape=(v, per_row)
        )
        self._map = np.asarray(mapped)
        self._scales = {r: _floats(t, source) for r, t in packed.parts.items()}
        if packed.kind == "mlx":
            groups = d // packed.group
            for role in ("scales", "biases"):
                self._scales[role] = self._scales[role].reshape(v, groups)
        elif packed.kind not in ("int8",):
            self._absmax = self._absmax_values()
        self.block_rows = max(1, (2 << 20) // (4 * d))
        self._buffer = None

    def _absmax_values(self) -> npt.NDArray[np.float32]:
        """The 4-bit blocks' absmax, double quantisation undone."""
        import numpy as np

        absmax = self._scales["absmax"]
        if self.packed.parts["absmax"].dtype != "U8":
            return absmax
        code, outer = self._scales["nested_quant_map"], self._scales["nested_absmax"]
        block = int(self.packed.state.get("nested_blocksize", 256))
        q = absmax.astype(np.int64)
        values = code[q] * outer[np.arange(q.size) // block]
        return (values + np.float32(self.packed.state.get("nested_offset", 0.0))).astype(np.float32)

    def values(self, raw: npt.NDArray[Any], ids: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
        """The packed rows `raw` (rows `ids` of the table) as float32."""
        import numpy as np

        kind, d = self.packed.kind, self.shape[1]
        if kind == "mlx":
            s, b = self._scales["scales"][ids], self._scales["biases"][ids]
            return mlx_values(raw, s, b, self.packed.bits, self.packed.group)
        if kind == "int8":
            w = raw.view(np.int8).astype(np.float32)
            return (w * self._scales["SCB"][ids][:, None]) * np.float32(INT8_SCALE)
        dtype = str(self.packed.state.get("dtype", "float32"))
        code = self._scales["quant_map"]
        return bnb_4bit_values(raw, code, self._absmax, ids * d, self.packed.group, dtype)

    def block(self, start: int, stop: int) -> npt.NDArray[np.float32]:
        import numpy as np

        return self.values(self._map[start:stop], np.arange(start, stop))

    def block_into(
        self, start: int, stop: int, out: npt.NDArray[np.float32]
    ) -> npt.NDArray[np.float32]:
        out[...] = self.block(start, stop)
        return out

    def take(self, ids: list[int]) -> npt.NDArray[np.float32]:
        import numpy as np

        index = np.asarray(ids, dtype=np.int64)
        return self.values(self._map[index], index)
