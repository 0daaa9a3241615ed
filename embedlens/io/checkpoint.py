"""Tensor names, shapes, dtypes and byte positions from checkpoint headers, without torch.

Safetensors: the 8-byte header length and the JSON header of each file (sharded checkpoints
through model.safetensors.index.json). GGUF: the header parsed by `gguf_header`. A hub repo whose
weights are not in the hub cache has its headers read over HTTP ranges (embedlens.io.ranges), and
`fetch_tensor` / `fetch_rows` fetch the bytes of one tensor or of some rows the same way.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import BinaryIO, Literal

from embedlens.errors import CheckpointError, SourceError
from embedlens.io.gguf import GGUFHeader, read_gguf_header
from embedlens.io.hub import hub_offline
from embedlens.io.ranges import HubFile, describe, has_kept, read_bytes, read_range
from embedlens.io.source import WEIGHT_INDEX, WEIGHT_SINGLE, ModelSource

# Bits per element of each safetensors dtype.
SAFETENSORS_BITS: dict[str, int] = {
    "F64": 64, "F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I32": 32, "I16": 16, "I8": 8,
    "U64": 64, "U32": 32, "U16": 16, "U8": 8, "BOOL": 8, "F8_E4M3": 8, "F8_E5M2": 8,
    "F8_E8M0": 8, "F6_E2M3": 6, "F6_E3M2": 6, "F4": 4,
}  # fmt: skip
TORCH_DTYPE_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}  # fmt: skip
_MAX_HEADER = 100_000_000  # safetensors itself refuses headers above 100 MB
_FIRST_RANGE = 100_000  # as huggingface_hub asks first: most headers fit
_U64 = 1 << 64


@dataclass(frozen=True)
class TensorEntry:
    """One stored tensor: its shape in row-major order and where its bytes are."""

    name: str
    dtype: str
    """Safetensors dtype ('BF16') or ggml type ('Q4_1')."""
    shape: tuple[int, ...]
    file: str
    """The file's name within the checkpoint (a shard name, or the .gguf file's name)."""
    path: Path | None
    """The file on disk, or None for a hub file whose header was read remotely."""
    file_offset: int | None
    """Absolute offset of the tensor's first byte in the file (None when not known)."""
    nbytes: int
    block: tuple[int, int] | None = None
    """GGUF quantisation block: (elements, bytes); None for plain element types."""
    base: int = 0
    """The file offset of `path`'s first byte: a range kept from the hub holds the file's bytes
    from there on (0 for the file itself)."""
    numel: int = field(init=False, compare=False, repr=False)
    """Number of elements."""

    def __post_init__(self) -> None:
        n = 1
        for d in self.shape:
            n *= d
        object.__setattr__(self, "numel", n)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (the last dimension) as stored."""
        if not self.shape:
            return self.nbytes
        rows = self.numel // self.shape[-1] if self.shape[-1] else 0
        return self.nbytes // rows if rows else 0


@dataclass(frozen=True)
class Checkpoint:
    """All tensors of a checkpoint, by name."""

    format: Literal["safetensors", "gguf"]
    tensors: dict[str, TensorEntry]
    files: tuple[str, ...]
    gguf: GGUFHeader | None = None
    unread: dict[str, str] = field(default_factory=dict)
    """Tensors named by the index whose shard is not in the hub cache while offline (name to
    shard); their headers were not read, so they are not in `tensors`. Only with `partial`."""
    metadata: dict[str, dict[str, str]] = field(default_factory=dict)
    """Each safetensors file's `__metadata__` as its header holds it, by file name."""
    index_metadata: dict[str, object] = field(default_factory=dict)
    """The `metadata` object of model.safetensors.index.json (`total_size`,
    `total_parameters`), empty without an index."""

    @property
    def stated_total(self) -> int | None:
        """The parameter count the index's or a header's metadata states (`total_parameters`),
        None where none states one."""
        found = [self.index_metadata.get("total_parameters")]
        found += [m.get("total_parameters") for m in self.metadata.values()]
        for value in found:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            if isinstance(value, str) and value.isdigit():
                return int(value)
        return None


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed safetensors header."""

    header_length: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


def read_safetensors_header(path: Path, name: str | None = None) -> SafetensorsHeader:
    """Parse and check one safetensors file's header; CheckpointError if it is corrupt."""
    name = name or path.name
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, 2)
            fh.seek(0)
            if size < 8:
                raise CheckpointError(
                    f"'{name}' is truncated: {size} bytes, not even the 8-byte header length"
                )
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > size - 8:
                raise CheckpointError(
                    f"'{name}' is truncated or corrupt: its header claims {n} bytes "
                    f"but the file has {size - 8} after the length"
                )
            if n > _MAX_HEADER:
                raise CheckpointError(f"'{name}' claims a header of {n} bytes (over 100 MB)")
            raw = fh.read(n)
    except OSError as e:
        raise CheckpointError(f"cannot read '{name}': {e.strerror or e}") from e
    return parse_safetensors_header(raw, name, path=path, data_size=size - 8 - n)


def parse_safetensors_header(
    raw: bytes, name: str, *, path: Path | None, data_size: int | None
) -> SafetensorsHeader:
    """Check a header's JSON against the spec and the size of the data that follows it."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        # ValueError covers JSONDecodeError and integers past Python's digit limit;
        # RecursionError, arrays nested thousands deep.
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
        raise CheckpointError(f"'{name}' has a corrupt header (not JSON: {reason})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"'{name}' has a corrupt header (not a JSON object)")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict):
        raise CheckpointError(f"'{name}' has a corrupt header (__metadata__ is not an object)")
    base = 8 + len(raw)
    tensors: dict[str, TensorEntry] = {}
    for tname, info in header.items():
        tensors[tname] = _entry(tname, info, name, path, base, data_size)
    _check_layout(tensors, name, base, data_size)
    return SafetensorsHeader(len(raw), tensors, {str(k): str(v) for k, v in metadata.items()})


def _check_layout(
    tensors: dict[str, TensorEntry], name: str, base: int, data_size: int | None
) -> None:
    """Tensors must tile the data without gaps or overlaps, as the safetensors library requires."""
    end = 0
    for t in sorted(tensors.values(), key=lambda t: (t.file_offset or 0, t.nbytes)):
        begin = (t.file_offset or 0) - base
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else "leaves a gap before it"
            raise CheckpointError(
                f"'{name}' has a corrupt header: tensor {_short(t.name)} at data offset {begin} "
                + what
            )
        end = begin + t.nbytes
    if data_size is not None and end != data_size:
        raise CheckpointError(
            f"'{name}' is corrupt: its tensors cover {end} bytes of data, the file holds {data_size}"
        )


def _entry(
    tname: str, info: object, name: str, path: Path | None, base: int, data_size: int | None
) -> TensorEntry:
    if not isinstance(info, dict):
        raise CheckpointError(_bad(name, tname))
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_BITS:
        raise CheckpointError(f"{_bad(name, tname)}: unknown dtype {_short(dtype)}")
    if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < _U64 for d in shape):
        raise CheckpointError(f"{_bad(name, tname)}: shape {_short(shape)}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and 0 <= o < _U64 for o in offsets)
        or not offsets[0] <= offsets[1]
    ):
        raise CheckpointError(f"{_bad(name, tname)}: data_offsets {_short(offsets)}")
    numel = 0 if 0 in shape else 1
    for d in shape if numel else ():
        numel *= d
        if numel >= _U64:  # checked as the safetensors library does: no giant products
            raise CheckpointError(
                f"{_bad(name, tname)}: shape {_short(shape)} has over 2**64 elements"
            )
    bits = numel * SAFETENSORS_BITS[dtype]
    if bits % 8:
        raise CheckpointError(
            f"{_bad(name, tname)}: {numel} {dtype} elements do not fill whole bytes"
        )
    begin, end = offsets
    if end - begin != bits // 8:
        raise CheckpointError(
            f"{_bad(name, tname)}: {end - begin} bytes for a {dtype} tensor of shape {_short(shape)} "
            f"({bits // 8} needed)"
        )
    if data_size is not None and end > data_size:
        raise CheckpointError(
            f"'{name}' is truncated: tensor {_short(tname)} ends at byte {end} of the data, "
            f"which has {data_size}"
        )
    return TensorEntry(
        name=tname,
        dtype=dtype,
        shape=tuple(shape),
        file=name,
        path=path,
        file_offset=base + begin,
        nbytes=end - begin,
    )


def _bad(name: str, tname: str) -> str:
    """The start of a corrupt header entry's error (made only when one is raised)."""
    return f"'{name}' has a corrupt header entry for {_short(tname)}"


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def gguf_checkpoint(path: Path) -> Checkpoint:
    """The tensors of a GGUF file, shapes in row-major order."""
    header = read_gguf_header(path)
    tensors = {
        t.name: TensorEntry(
            name=t.name,
            dtype=t.type_name,
            shape=t.shape,
            file=path.name,
            path=path,
            file_offset=t.offset,
            nbytes=t.nbytes,
            block=t.block if t.block != (1, t.block[1]) else None,
        )
        for t in header.tensors.values()
    }
    return Checkpoint("gguf", tensors, (path.name,), gguf=header)


def safetensors_files(source: ModelSource) -> tuple[list[str] | None, Path | None]:
    """Names of the safetensors files holding the weights (via the index when sharded), and the
    index (None without one).

    Only the index (a small JSON file) is ever downloaded here; weight files are not.
    """
    index = source.find(WEIGHT_INDEX)
    if index is not None:
        weight_map = _read_index(index)
        return sorted(set(weight_map.values())), index
    if source.kind == "hub":
        if source.cached(WEIGHT_SINGLE) is not None or _hub_has(source, WEIGHT_SINGLE):
            return [WEIGHT_SINGLE], None
    elif source.find(WEIGHT_SINGLE) is not None:
        return [WEIGHT_SINGLE], None
    listing = source.listing() or []
    shards = [n for n in listing if n.endswith(".safetensors") and "adapter" not in n]
    return shards or None, None


def _hub_has(source: ModelSource, name: str) -> bool:
    """Whether a hub repo holds a file, asked without downloading it (offline: whether ranges of
    it were kept)."""
    assert source.repo_id is not None
    if hub_offline():
        return has_kept(source.repo_id, name, source.revision)
    from huggingface_hub.errors import EntryNotFoundError

    try:
        describe(source.repo_id, name, source.revision)  # a HEAD request, kept for the reads
    except EntryNotFoundError:
        return False
    return True


def _read_index(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise TypeError("weight_map is not a mapping of names to files")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"'{path.name}' is not a valid safetensors index ({e})") from e
    for shard in weight_map.values():
        if "/" in shard or "\\" in shard or shard.startswith("."):
            raise CheckpointError(f"'{path.name}' names a shard outside the model: '{shard}'")
    return weight_map


def open_checkpoint(source: ModelSource, *, partial: bool = False) -> Checkpoint | None:
    """Read every tensor's header entry; None when the weights are not in safetensors or GGUF.

    `partial`: a hub repo's shards that are not cached while offline are left unread (their
    tensors, named by the index, go in `unread`) rather than an error; for a command that reads
    only some tensors.
    """
    if source.is_gguf:
        assert source.path is not None
        ckpt = gguf_checkpoint(source.path)
        if not source.remote:
            return ckpt
        # A hub GGUF's sparse copy holds its header alone: its tensors are fetched when read.
        return replace(ckpt, tensors={n: replace(t, path=None) for n, t in ckpt.tensors.items()})
    names, index = safetensors_files(source)
    if names is None:
        return None
    tensors: dict[str, TensorEntry] = {}
    metadata: dict[str, dict[str, str]] = {}
    remote: list[str] = []
    for shard in names:
        path = source.cached(shard) if source.kind == "hub" else source.find(shard)
        if path is None:
            if source.kind != "hub":
                raise CheckpointError(
                    f"shard '{shard}' named in {WEIGHT_INDEX} is missing from '{source.spec}'"
                )
            remote.append(shard)
            continue
        header = read_safetensors_header(path, shard)
        tensors.update(header.tensors)
        metadata[shard] = header.metadata
    unread: dict[str, str] = {}
    if remote:
        found, missing = _remote_headers(source, remote)
        tensors.update(found)
        if missing and not partial:
            raise offline_error(source, missing[0], len(missing))
        if missing:
            weight_map = _read_index(index) if index is not None else {}
            unread = {n: s for n, s in weight_map.items() if s in missing}
    return Checkpoint(
        "safetensors",
        tensors,
        tuple(names),
        unread=unread,
        metadata=metadata,
        index_metadata=_index_metadata(index) if index is not None else {},
    )


def _index_metadata(path: Path) -> dict[str, object]:
    """The index's `metadata` object (read when the index is; {} where it has none)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    meta = data.get("metadata") if isinstance(data, dict) else None
    return meta if isinstance(meta, dict) else {}


def _remote_headers(
    source: ModelSource, shards: list[str]
) -> tuple[dict[str, TensorEntry], list[str]]:
    """Headers of hub files that are not in the hub cache, read over HTTP ranges (or, offline,
    from the kept ranges): their tensors, and the shards offline left unread."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(8, len(shards))) as pool:
        headers = list(pool.map(lambda shard: _remote_header(source, shard), shards))
    out: dict[str, TensorEntry] = {}
    missing = []
    for shard, header in zip(shards, headers, strict=True):
        if header is None:
            missing.append(shard)
        else:
            out.update(header.tensors)
    return out, missing


def _remote_header(source: ModelSource, shard: str) -> SafetensorsHeader | None:
    """One hub file's safetensors header by range; None offline when it was never kept."""
    assert source.repo_id is not None
    if hub_offline() and not has_kept(source.repo_id, shard, source.revision):
        return None
    hub = describe(source.repo_id, shard, source.revision)
    n, raw = _header_bytes(hub)
    return parse_safetensors_header(raw, shard, path=None, data_size=hub.size - 8 - n)


def _header_bytes(hub: HubFile) -> tuple[int, bytes]:
    """(header length, header JSON bytes) of a hub safetensors file: its first 100 KB, then
    the rest of the header when it is longer (as huggingface_hub reads it)."""
    name = hub.filename
    if hub.size < 8:
        raise CheckpointError(
            f"'{name}' is truncated: {hub.size} bytes, not even the 8-byte header length"
        )
    first = read_bytes(hub, 0, _FIRST_RANGE)
    (n,) = struct.unpack("<Q", first[:8])
    if n > hub.size - 8:
        raise CheckpointError(
            f"'{name}' is truncated or corrupt: its header claims {n} bytes "
            f"but the file has {hub.size - 8} after the length"
        )
    if n > _MAX_HEADER:
        raise CheckpointError(f"'{name}' claims a header of {n} bytes (over 100 MB)")
    raw = first[8 : 8 + n] if 8 + n <= len(first) else read_bytes(hub, 8, 8 + n)
    return n, raw


def fetch_tensor(source: ModelSource, entry: TensorEntry) -> TensorEntry:
    """The entry with its bytes on disk: the tensor's byte range of a hub file, fetched (or
    kept from an earlier run)."""
    assert source.repo_id is not None and entry.file_offset is not None
    hub = describe(source.repo_id, source.hub_file or entry.file, source.revision)
    path, base = read_range(hub, entry.file_offset, entry.file_offset + entry.nbytes)
    return replace(entry, path=path, base=base)


def fetch_gguf_rows(source: ModelSource, entry: TensorEntry, rows: list[int]) -> Path:
    """The sparse copy of a hub GGUF (its header) with the given rows of a tensor written at
    their offsets (fetched, or kept from an earlier run): what gguf's own reader needs to read
    those rows."""
    assert source.repo_id is not None and source.hub_file is not None
    assert source.path is not None and entry.file_offset is not None
    hub = describe(source.repo_id, source.hub_file, source.revision)
    with open(source.path, "r+b") as out:
        _write_rows(out, hub, entry, rows)
    return source.path


def fetch_rows(source: ModelSource, entry: TensorEntry, rows: list[int], folder: Path) -> Path:
    """A sparse copy of a hub safetensors file in folder: its header and the given rows at their
    offsets, holes elsewhere (what safetensors' own loader needs to read those rows)."""
    assert source.repo_id is not None and entry.file_offset is not None
    hub = describe(source.repo_id, entry.file, source.revision)
    n, raw = _header_bytes(hub)
    path = folder / entry.file
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", n) + raw)
        out.truncate(hub.size)
        _write_rows(out, hub, entry, rows)
    return path


def _write_rows(out: BinaryIO, hub: HubFile, entry: TensorEntry, rows: list[int]) -> None:
    """Each row's bytes (fetched by range, or kept from an earlier run) at its file offset."""
    assert entry.file_offset is not None
    for row in sorted(set(rows)):
        start = entry.file_offset + row * entry.row_bytes
        kept, base = read_range(hub, start, start + entry.row_bytes)
        with open(kept, "rb") as fh:
            fh.seek(start - base)
            out.seek(start)
            out.write(fh.read(entry.row_bytes))


def offline_error(source: ModelSource, shard: str, count: int = 1) -> SourceError:
    """A weights file (one of `count`) the command needs is not cached, and offline."""
    more = f", and {count - 1} more weights file{'s' if count > 2 else ''}" if count > 1 else ""
    return SourceError(
        f"'{source.spec}' is not in the local hub cache ({shard}{more}) and HF_HUB_OFFLINE is set",
        hint="unset HF_HUB_OFFLINE to download it, or use --meta-only to count from the config "
        "alone",
    )
