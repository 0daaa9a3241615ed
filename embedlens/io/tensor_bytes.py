"""The bytes of stored tensors, read where they are on disk: a small tensor whole (a packed
weight's stored shape, a quantiser's state), and whether two tensors hold the same bytes."""

from __future__ import annotations

from embedlens.errors import CheckpointError
from embedlens.io.checkpoint import TensorEntry


def small_tensor_bytes(entry: TensorEntry, *, limit: int = 64) -> bytes | None:
    """A small tensor's bytes where they are on disk (a packed weight's stored shape, a
    quantiser's state); None when they are not, are over `limit`, or are all zero (a sparse
    file's hole)."""
    if entry.path is None or entry.file_offset is None or entry.nbytes > limit:
        return None
    try:
        with open(entry.path, "rb") as fh:
            fh.seek(entry.file_offset - entry.base)
            raw = fh.read(entry.nbytes)
    except OSError:
        return None
    return raw if len(raw) == entry.nbytes and any(raw) else None


def same_bytes(a: TensorEntry, b: TensorEntry, *, chunk: int = 1 << 20) -> bool | None:
    """Whether two stored tensors hold identical bytes; None when either is not on disk."""
    if a.path is None or b.path is None or a.file_offset is None or b.file_offset is None:
        return None
    if (a.dtype, a.shape, a.nbytes) != (b.dtype, b.shape, b.nbytes):
        return False
    try:
        with open(a.path, "rb") as fa, open(b.path, "rb") as fb:
            fa.seek(a.file_offset - a.base)
            fb.seek(b.file_offset - b.base)
            left = a.nbytes
            while left > 0:
                n = min(chunk, left)
                if fa.read(n) != fb.read(n):
                    return False
                left -= n
    except OSError as e:
        raise CheckpointError(f"cannot read '{a.file}': {e.strerror or e}") from e
    return True
