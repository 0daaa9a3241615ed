"""The bytes of stored tensors, read where they are on disk: a small tensor whole (a packed
weight's stored shape, a quantiser's state), and whether two tensors hold the same bytes; and
tensors written as a safetensors file whose bytes do not change from one process to the next."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from embedlens.errors import CheckpointError
from embedlens.io.checkpoint import TensorEntry

if TYPE_CHECKING:
    import torch


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


_STORED = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64"}
"""safetensors' names of the dtypes a states file holds."""


def write_safetensors(
    path: str | os.PathLike[str], tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> None:
    """`tensors` and `metadata` as a safetensors file, laid out as safetensors' own `save_file`
    lays them out (the widest dtype first, then by name; the header padded to 8 bytes), but for
    the metadata, written in sorted order: `save_file` keeps it in a hash map whose order
    changes from one process to the next, and the same states would not give the same bytes."""
    import json
    import struct

    import torch

    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        dtype = _STORED[str(t.dtype).removeprefix("torch.")]
        header[name] = {
            "dtype": dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)))
        fh.write(text)
        for name in order:
            data = tensors[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            fh.write(data.numpy().data)
