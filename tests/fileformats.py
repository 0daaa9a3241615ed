"""Writers of small safetensors and GGUF files, byte by byte, for the fuzz and bad-input tests.

They follow the formats' specs directly (not through the libraries under test), so a test can
build a valid file, then truncate or mutate it.
"""

from __future__ import annotations

import json
import struct
from typing import Any

# ggml type id -> (elements per block, bytes per block), a few of each kind.
GGML_BLOCKS: dict[int, tuple[int, int]] = {
    0: (1, 4),  # F32
    1: (1, 2),  # F16
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    8: (32, 34),  # Q8_0
    12: (256, 144),  # Q4_K
    30: (1, 2),  # BF16
}
ST_BITS = {"F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I8": 8, "U8": 8, "BOOL": 8, "F64": 64}


def safetensors_bytes(
    tensors: dict[str, tuple[str, list[int]]], metadata: dict[str, str] | None = None
) -> bytes:
    """A valid safetensors file: tensors laid out in order, filled with a counting pattern."""
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    data = bytearray()
    for name, (dtype, shape) in tensors.items():
        numel = 1
        for d in shape:
            numel *= d
        n = numel * ST_BITS[dtype] // 8
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + n]}
        data += bytes((len(data) + i) % 251 for i in range(n))
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the library pads the header to 8 bytes
    return struct.pack("<Q", len(raw)) + raw + bytes(data)


def _block(type_id: int) -> tuple[int, int]:
    """(elements, bytes) per block: the few above, else from the gguf package's table."""
    if type_id in GGML_BLOCKS:
        return GGML_BLOCKS[type_id]
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]


def _gguf_str(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


_SCALAR_FMT = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
    11: "<q", 12: "<d",
}  # fmt: skip


def gguf_value(vtype: int, value: Any) -> bytes:
    """One GGUF metadata value of a scalar, string (8) or array (9: value = (item type, items))."""
    if vtype in _SCALAR_FMT:
        return struct.pack(_SCALAR_FMT[vtype], value)
    if vtype == 8:
        return _gguf_str(value)
    item_type, items = value
    body = b"".join(gguf_value(item_type, v) for v in items)
    return struct.pack("<IQ", item_type, len(items)) + body


def gguf_bytes(
    metadata: list[tuple[str, int, Any]],
    tensors: list[tuple[str | bytes, tuple[int, ...], int]],
    *,
    version: int = 3,
) -> bytes:
    """A valid GGUF file: metadata (key, type, value), tensors (name, ggml dims, type), data."""
    alignment = next((v for k, t, v in metadata if k == "general.alignment" and t == 4), 32)
    out = bytearray(b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(metadata)))
    for key, vtype, value in metadata:
        out += _gguf_str(key) + struct.pack("<I", vtype) + gguf_value(vtype, value)
    offset = 0
    sizes = []
    for name, dims, type_id in tensors:
        elems, block = _block(type_id)
        numel = 1
        for d in dims:
            numel *= d
        nbytes = numel // elems * block
        out += _gguf_str(name) + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", type_id, offset)
        sizes.append(nbytes)
        offset += nbytes + (-nbytes % alignment)
    out += bytes(-len(out) % alignment)
    for nbytes in sizes:
        out += bytes(i % 251 for i in range(nbytes)) + bytes(-nbytes % alignment)
    return bytes(out)
