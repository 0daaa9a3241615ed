"""A GGUF file on the hub (`REPO:FILE.gguf`), read without downloading it whole.

Its header (metadata, the tokenizer's arrays, tensor infos) is read by growing ranges, as hf-mem
reads it: the first MiB, then twice as much as was read (or what the header's lengths ask for)
until the header parses whole, through the ranged reads and kept ranges of embedlens.io.ranges.
The header's bytes are then written at the start of a sparse file of the hub file's size, in a
temporary folder of the process, so that every reader of a local GGUF header works unchanged.
The tensors' bytes are not in it (holes): tensor entries of such a source are marked not on disk,
and a command fetches the tensor (or rows) it reads by range (embedlens.io.checkpoint).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
from pathlib import Path, PurePosixPath

from embedlens.errors import SourceError
from embedlens.io.gguf import HeaderShort, parse_gguf_start
from embedlens.io.ranges import HubFile, describe, read_bytes

FIRST_RANGE = 1 << 20
"""The first bytes of a hub GGUF read for its header; the reads then double."""

_sparse: dict[tuple[str, str, str, str], Path] = {}
_lock = threading.Lock()


def split_spec(spec: str) -> tuple[str, str] | None:
    """(repo id, file) of MODEL written `REPO:FILE.gguf`; None for any other MODEL."""
    repo, sep, name = spec.partition(":")
    if not sep or not name.lower().endswith(".gguf"):
        return None
    parts = PurePosixPath(name).parts
    if name.startswith(("/", "\\")) or "\\" in name or ".." in parts or "." in name.split("/"):
        return None
    return repo, name


def header_copy(repo_id: str, filename: str, revision: str | None) -> tuple[Path, HubFile]:
    """A sparse local copy of a hub GGUF holding its header's bytes, and the hub file."""
    from huggingface_hub.errors import EntryNotFoundError

    try:
        hub = describe(repo_id, filename, revision)
    except EntryNotFoundError as e:
        at = f" at revision '{revision}'" if revision else ""
        raise SourceError(f"'{repo_id}'{at} has no file '{filename}'") from e
    key = (repo_id, hub.commit, filename, hub.etag)
    with _lock:
        if key not in _sparse:
            _sparse[key] = _write_copy(hub)
        return _sparse[key], hub


def _write_copy(hub: HubFile) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="embedlens-gguf-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = folder / PurePosixPath(hub.filename).name
    raw = header_bytes(hub, path)
    with open(path, "wb") as out:
        out.write(raw)
        out.truncate(hub.size)  # holes: no disk space, and never read (entries are remote)
    return path


def header_bytes(hub: HubFile, path: Path) -> bytes:
    """The hub file's first bytes, enough to hold its whole header: read by growing ranges
    (CheckpointError when the header is malformed)."""
    raw = read_bytes(hub, 0, min(FIRST_RANGE, hub.size))
    while True:
        try:
            parse_gguf_start(path, raw, hub.size)
        except HeaderShort as e:
            stop = min(hub.size, max(2 * len(raw), e.needed))
            raw += read_bytes(hub, len(raw), stop)
            continue
        return raw
