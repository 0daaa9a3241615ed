"""A small, bounds-checked reader of GGUF headers: metadata and tensor infos, no tensor data.

gguf-py's GGUFReader decodes every token string up front (seconds for a 49k vocabulary); this
reader walks the same layout with `struct` over a memory map, decodes scalars and short arrays,
and leaves long arrays as lazy views. Every length field is checked against the bytes left, so a
corrupt file ends in CheckpointError, never in a huge allocation or a foreign exception.
"""

from __future__ import annotations

import functools
import itertools
import mmap
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embedlens.errors import CheckpointError

GGUF_MAGIC = b"GGUF"
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}  # fmt: skip
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
_EAGER_ARRAY_LIMIT = 256
_MAX_DIMS = 8
# Bounds on what a header may claim, whatever the file's size, so that a corrupt count costs
# neither minutes of parsing nor gigabytes of memory. Real files stay far below them: the largest
# vocabularies hold about 262k tokens, the largest models a few thousand tensors.
MAX_ENTRIES = 1 << 20  # metadata pairs, tensors
MAX_ARRAY = 1 << 22  # items in one metadata array
MAX_STRING_BYTES = 16 << 20  # bytes of keys, names and metadata strings decoded in all
MAX_ARRAY_BYTES = 256 << 20  # bytes of one string array left in the file (tokens: a few MB)


@functools.cache
def ggml_types() -> dict[int, tuple[str, int, int]]:
    """ggml type id -> (name, elements per block, bytes per block), from the `gguf` package's
    table. Its constants module is loaded alone: `import gguf` would pull in its reader, writer
    and numpy (0.4 s), while the table itself costs a few milliseconds."""
    from embedlens.compat.gguf import constants as alone

    constants = sys.modules.get("gguf.constants") or alone()
    sizes: dict[Any, tuple[int, int]] = constants.GGML_QUANT_SIZES
    return {int(t): (t.name, *sizes[t]) for t in constants.GGMLQuantizationType if t in sizes}


@dataclass(frozen=True)
class LazyArray:
    """A long metadata array left in the file: its element type, count and byte span."""

    path: Path
    item_type: int
    count: int
    start: int
    end: int

    def read(self) -> list[Any]:
        """Decode the array (e.g. the tokenizer's token strings)."""
        with open(self.path, "rb") as fh:
            fh.seek(self.start)
            buf = fh.read(self.end - self.start)
        cursor = _Cursor(buf, 0, str(self.path), budget=len(buf))
        return [cursor.value(self.item_type) for _ in range(self.count)]

    def items_at(self, indices: Iterable[int]) -> dict[int, Any]:
        """Only the given items, read where they lie: a string as its raw bytes (strings are
        walked to the last index asked for, without decoding the others), a number as itself."""
        wanted = sorted({i for i in indices if 0 <= i < self.count})
        if not wanted:
            return {}
        with open(self.path, "rb") as fh:
            if self.item_type in _SCALARS:
                fmt, size = _SCALARS[self.item_type]
                out = {}
                for i in wanted:
                    fh.seek(self.start + i * size)
                    out[i] = struct.unpack(fmt, fh.read(size))[0]
                return out
            if self.item_type != _STRING:
                raise CheckpointError(f"'{self.path.name}' has an unsupported GGUF array type")
            fh.seek(self.start)
            buf = fh.read(self.end - self.start)
        found: dict[int, Any] = {}
        pos, unpack, want = 0, _U64.unpack_from, set(wanted)
        for i in range(wanted[-1] + 1):  # the span was checked when the header was parsed
            (n,) = unpack(buf, pos)
            if i in want:
                found[i] = bytes(buf[pos + 8 : pos + 8 + n])
            pos += 8 + n
        return found


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's record in a GGUF header (shape in ggml order: fastest dimension first), with
    the figures its type gives, worked out once when the record is made."""

    name: str
    ggml_shape: tuple[int, ...]
    type_id: int
    offset: int
    """Absolute byte offset of the data in the file."""
    type_name: str = field(init=False, compare=False, repr=False)
    """ggml type name, e.g. 'Q4_1' ('' for a type embedlens does not know: refused by the parse)."""
    shape: tuple[int, ...] = field(init=False, compare=False, repr=False)
    """Shape in row-major (PyTorch) order."""
    numel: int = field(init=False, compare=False, repr=False)
    """Number of elements."""
    block: tuple[int, int] = field(init=False, compare=False, repr=False)
    """(elements per block, bytes per block) of its type."""
    row_bytes: int = field(init=False, compare=False, repr=False)
    """Bytes of one row (the fastest dimension) in the file's quantised layout."""
    nbytes: int = field(init=False, compare=False, repr=False)
    """Bytes of the whole tensor."""

    def __post_init__(self) -> None:
        dims = self.ggml_shape
        type_name, elems, size = ggml_types().get(self.type_id, ("", 1, 0))
        numel = 1
        for d in dims:
            numel *= d
        row_bytes = (dims[0] // elems) * size if dims else size
        rows = 1 if not dims else numel // dims[0] if dims[0] else 0  # rows of 0: refused
        found = {
            "type_name": type_name,
            "shape": tuple(reversed(dims)),
            "numel": numel,
            "block": (elems, size),
            "row_bytes": row_bytes,
            "nbytes": row_bytes * rows,
        }
        for key, value in found.items():
            object.__setattr__(self, key, value)


@dataclass(frozen=True)
class GGUFHeader:
    """A parsed GGUF header."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    data_offset: int
    alignment: int

    def meta(self, key: str, default: Any = None) -> Any:
        """A metadata value, with `{arch}` standing for general.architecture."""
        arch = self.metadata.get("general.architecture", "")
        return self.metadata.get(key.replace("{arch}", str(arch)), default)


class HeaderShort(CheckpointError):
    """The bytes given end inside the header of a longer file: `needed` bytes from its start
    are needed at least (raised only when the file's whole size is known)."""

    def __init__(self, where: str, needed: int) -> None:
        super().__init__(f"'{where}': its header runs past the {needed} bytes read")
        self.needed = needed


class _Cursor:
    def __init__(
        self,
        buf: Any,
        pos: int,
        where: str,
        budget: int = MAX_STRING_BYTES,
        file_size: int | None = None,
    ) -> None:
        self.buf, self.pos, self.where, self.size = buf, pos, where, len(buf)
        self.budget = budget
        self.file_size = self.size if file_size is None else file_size
        """The whole file's size: buf may hold only its first bytes."""

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            self.short(self.pos + n if n >= 0 else -1)
            raise CheckpointError(
                f"'{self.where}' is truncated or corrupt: {what} runs past the end of the file "
                f"(needs {n} bytes at offset {self.pos}, file has {self.file_size})"
            )

    def short(self, end: int, array_start: int | None = None) -> None:
        """HeaderShort when buf holds only the file's first bytes and `end` lies in the file
        (CheckpointError instead when a string array from array_start spans more than it may:
        nothing more is read for it)."""
        if not self.size < end <= self.file_size:
            return
        if array_start is not None and end - array_start > MAX_ARRAY_BYTES:
            raise CheckpointError(
                f"'{self.where}' is corrupt: a string array at offset {array_start} spans over "
                f"{end - array_start} bytes (at most {MAX_ARRAY_BYTES >> 20} MiB are read)"
            )
        raise HeaderShort(self.where, end)

    def scalar(self, fmt: str, size: int, what: str) -> Any:
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return int(self.scalar("<I", 4, what))

    def u64(self, what: str) -> int:
        return int(self.scalar("<Q", 8, what))

    def string(self, what: str = "a string", *, strict: bool = False) -> str:
        n = self.u64(what)
        if n > self.budget and self.pos + n > self.file_size:
            self.need(n, what)  # past the end of the file: that is the error
        if n > self.budget:
            raise CheckpointError(
                f"'{self.where}' is corrupt: {what} at offset {self.pos - 8} claims {n} bytes, "
                f"past the {MAX_STRING_BYTES >> 20} MiB its header's strings may take in all"
            )
        self.need(n, what)
        self.budget -= n
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        if not strict:
            return raw.decode("utf-8", errors="surrogateescape")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(
                f"'{self.where}' is corrupt: {what} at offset {self.pos - n} is not UTF-8"
            ) from None

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            fmt, size = _SCALARS[vtype]
            return self.scalar(fmt, size, "a metadata value")
        if vtype == _STRING:
            return self.string("a metadata string")
        raise CheckpointError(f"'{self.where}' has an unknown GGUF value type {vtype}")

    def skip_array(self, item_type: int, count: int) -> None:
        if count > MAX_ARRAY:
            raise CheckpointError(
                f"'{self.where}' is corrupt: a metadata array at offset {self.pos} claims "
                f"{count} items (at most {MAX_ARRAY} are read)"
            )
        if item_type in _SCALARS:
            self.need(count * _SCALARS[item_type][1], "a metadata array")
            self.pos += count * _SCALARS[item_type][1]
            return
        if item_type != _STRING:
            raise CheckpointError(f"'{self.where}' has an unsupported GGUF array type {item_type}")
        self.need(count * 8, "a string array")  # every string has at least its 8-byte length
        pos = self._strings_end(count)
        if pos is not None and pos - self.pos <= MAX_ARRAY_BYTES:
            self.pos = pos
            return
        pos, size, buf, unpack = self.pos, self.size, self.buf, _U64.unpack_from
        for _ in range(count):  # walked again, checked at every string, for the error
            if pos + 8 > size:
                self.short(pos + 8, self.pos)
                break
            pos += 8 + unpack(buf, pos)[0]
            if pos > size:
                self.short(pos, self.pos)
                break
        else:
            if pos - self.pos > MAX_ARRAY_BYTES:
                raise CheckpointError(
                    f"'{self.where}' is corrupt: a string array at offset {self.pos} spans "
                    f"{pos - self.pos} bytes (at most {MAX_ARRAY_BYTES >> 20} MiB are read)"
                )
            self.pos = pos
            return
        raise CheckpointError(
            f"'{self.where}' is truncated or corrupt: a string array starting at offset "
            f"{self.pos} runs past the end of the file ({self.file_size} bytes)"
        )

    def _strings_end(self, count: int) -> int | None:
        """Where `count` strings from pos end, walked with no check but the one `unpack_from`
        makes (a vocabulary has 10^5 strings; a third of the time); None when they run past
        the bytes held (skip_array walks them again to say how)."""
        pos, buf, unpack = self.pos, self.buf, _U64.unpack_from
        try:
            for _ in itertools.repeat(None, count):
                pos += 8 + unpack(buf, pos)[0]
        except (struct.error, OverflowError):  # a length field past the end, or past any file
            return None
        return pos if pos <= self.size else None


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse the header of a GGUF file; CheckpointError on anything malformed."""
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, 2)
            if size < 24:
                raise CheckpointError(
                    f"'{path.name}' is too short to be a GGUF file ({size} bytes)"
                )
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(path, buf)
    except OSError as e:
        raise CheckpointError(f"cannot read '{path}': {e.strerror or e}") from e


def parse_gguf_start(path: Path, buf: bytes, file_size: int) -> GGUFHeader:
    """Parse a GGUF header from the first bytes of a file of file_size bytes (a hub file read by
    range); HeaderShort when they end inside the header, CheckpointError when it is malformed.
    Long arrays are left to be read from `path`, which must hold the same bytes."""
    if file_size < 24:
        raise CheckpointError(f"'{path.name}' is too short to be a GGUF file ({file_size} bytes)")
    if len(buf) < 24:
        raise HeaderShort(path.name, 24)
    return _parse(path, buf, file_size)


def _parse(path: Path, buf: Any, file_size: int | None = None) -> GGUFHeader:
    """Read the header in buf in file order: counts, metadata, tensor infos; check each tensor.
    file_size: the whole file's, when buf holds only its first bytes."""
    where = path.name
    size = len(buf) if file_size is None else file_size
    cur, version, n_tensors, n_kv = _preamble(buf, where, size)
    metadata = _read_metadata(cur, path, n_kv)
    alignment = _alignment(metadata, where)
    infos = [_read_tensor_info(cur, where) for _ in range(n_tensors)]
    data_offset = (cur.pos + alignment - 1) // alignment * alignment
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, dims, type_id, offset in infos:
        if name in tensors:
            raise CheckpointError(f"'{where}' is corrupt: tensor {_short(name)} appears twice")
        info = GGUFTensorInfo(name, dims, type_id, data_offset + offset)
        _check_tensor(info, offset, alignment, size, where)
        tensors[name] = info
    return GGUFHeader(path, version, metadata, tensors, data_offset, alignment)


def _preamble(buf: Any, where: str, file_size: int) -> tuple[_Cursor, int, int, int]:
    """Check the magic and version; return a cursor past the counts, the version, the tensor
    count and the metadata count."""
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise CheckpointError(f"'{where}' is not a GGUF file (bad magic {bytes(buf[:4])!r})")
    cur = _Cursor(buf, 4, where, file_size=file_size)
    version = cur.u32("the version")
    if version not in (2, 3):
        raise CheckpointError(f"'{where}' has GGUF version {version}; versions 2 and 3 are read")
    n_tensors = cur.u64("the tensor count")
    n_kv = cur.u64("the metadata count")
    if max(n_tensors, n_kv) > MAX_ENTRIES:
        raise CheckpointError(
            f"'{where}' is corrupt: its header claims {n_tensors} tensors and {n_kv} metadata "
            f"pairs (at most {MAX_ENTRIES} of each are read)"
        )
    # Each metadata pair takes at least 8 + 4 + 1 bytes, each tensor info at least 8 + 4 + 4 + 8.
    cur.need(n_kv * 13 + n_tensors * 24, "the header's entries")
    return cur, version, n_tensors, n_kv


def _read_metadata(cur: _Cursor, path: Path, n_kv: int) -> dict[str, Any]:
    """Read n_kv metadata pairs; long arrays are skipped and kept as LazyArray."""
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string("a metadata key", strict=True)
        if key in metadata:
            raise CheckpointError(
                f"'{path.name}' is corrupt: metadata key {_short(key)} appears twice"
            )
        vtype = cur.u32("a metadata type")
        metadata[key] = _read_array(cur, path) if vtype == _ARRAY else cur.value(vtype)
    return metadata


def _read_array(cur: _Cursor, path: Path) -> list[Any] | LazyArray:
    """Read an array value (its item type and length first): a list when short, else lazily."""
    item_type = cur.u32("an array type")
    count = cur.u64("an array length")
    start = cur.pos
    if count <= _EAGER_ARRAY_LIMIT:
        if item_type == _ARRAY:
            raise CheckpointError(f"'{path.name}' has nested arrays, which are not read")
        return [cur.value(item_type) for _ in range(count)]
    cur.skip_array(item_type, count)
    return LazyArray(path, item_type, count, start, cur.pos)


def _alignment(metadata: dict[str, Any], where: str) -> int:
    """general.alignment (32 when absent); CheckpointError unless a positive power of two."""
    alignment = metadata.get("general.alignment", 32)
    if (
        not isinstance(alignment, int)
        or isinstance(alignment, bool)
        or alignment <= 0
        or alignment & (alignment - 1)
    ):
        raise CheckpointError(f"'{where}' has an invalid alignment {_short(alignment)}")
    return alignment


def _read_tensor_info(cur: _Cursor, where: str) -> tuple[str, tuple[int, ...], int, int]:
    """One tensor info: (name, dims, ggml type, offset from the data section)."""
    name = cur.string("a tensor name", strict=True)
    n_dims = cur.u32("a tensor's rank")
    if n_dims > _MAX_DIMS:
        raise CheckpointError(f"'{where}': tensor {_short(name)} claims {n_dims} dimensions")
    dims = tuple(cur.u64("a tensor's shape") for _ in range(n_dims))
    type_id = cur.u32("a tensor's type")
    offset = cur.u64("a tensor's offset")
    return name, dims, type_id, offset


def _check_tensor(info: GGUFTensorInfo, offset: int, alignment: int, size: int, where: str) -> None:
    """CheckpointError unless the tensor has a known type, is aligned, fills whole blocks and
    lies within the file's size bytes."""
    label = _short(info.name)
    if info.type_id not in ggml_types():
        raise CheckpointError(
            f"'{where}': tensor {label} has ggml type {info.type_id}, which embedlens cannot read"
        )
    if offset % alignment:
        raise CheckpointError(
            f"'{where}' is corrupt: tensor {label} starts at data offset {offset}, which "
            f"breaks the file's {alignment}-byte alignment"
        )
    elems, _ = info.block
    if info.ggml_shape and (info.ggml_shape[0] == 0 or info.ggml_shape[0] % elems):
        raise CheckpointError(
            f"'{where}': tensor {label} rows of {info.ggml_shape[0]} do not fill {info.type_name} blocks"
        )
    if info.offset + info.nbytes > size:
        raise CheckpointError(
            f"'{where}' is truncated: tensor {label} ends at byte {info.offset + info.nbytes}"
            f" but the file has {size}"
        )
