"""Rows of an embedding or head stored quantised in safetensors, dequantised with numpy alone.

- MLX (affine, 2, 4 or 8 bits): `weight` U32 [V, d * bits / 32], 32 / bits values a word, the
  lowest bits first, `scales` and `biases` [V, d / group_size]; a value is
  q * scale + bias in float32 (mlx.core.dequantize's formula; MLX returns it in the scales'
  dtype, here it stays float32).
- bitsandbytes int8 (LLM.int8): `weight` I8 [V, d] and `SCB` [V]; a value is
  w * SCB * (1/127) in float32, as bitsandbytes' int8_vectorwise_dequant computes it.
- bitsandbytes 4-bit (nf4, fp4): `weight` U8 [V * d / 2, 1], two values a byte (the high nibble
  first) over the flattened tensor, `weight.absmax` per block of `blocksize`, `weight.quant_map`
  (the 16 code values) and the state JSON (shape, blocksize, dtype); with double quantisation the
  absmax is itself uint8, read through `nested_quant_map` and `nested_absmax` per block of
  `nested_blocksize`, plus `nested_offset`. A value is quant_map[q] * absmax[block] in float32,
  rounded to the state's dtype: what bitsandbytes' dequantize_4bit returns.

Row i of a 4-bit table is the flattened range [i * d, (i + 1) * d): bytes [i * d / 2, ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from embedlens.io.checkpoint import Checkpoint, TensorEntry
from embedlens.io.tensor_bytes import small_tensor_bytes
from embedlens.model.quant.config import mlx_settings

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt


INT8_SCALE = 7.874015718698502e-3  # bitsandbytes' 1/127, as its int8 dequantiser writes it
FLOATS = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}


@dataclass(frozen=True)
class Packed:
    """A quantised [V, d] table: its packed tensor, the tensors that scale it and its settings."""

    kind: str
    """'mlx', 'int8' (bitsandbytes) or 'nf4'/'fp4' (bitsandbytes 4-bit)."""
    shape: tuple[int, int]
    weight: TensorEntry
    parts: dict[str, TensorEntry]
    """The bookkeeping read with it, by role ('scales', 'biases', 'SCB', 'absmax', ...)."""
    bits: int
    group: int
    """MLX's group size, or bitsandbytes' 4-bit block size (0 for int8)."""
    state: dict[str, Any] = field(default_factory=dict)
    """bitsandbytes' 4-bit state JSON."""

    @property
    def row_bytes(self) -> int:
        """Packed bytes of one row."""
        d = self.shape[1]
        if self.kind == "mlx":
            return self.weight.row_bytes
        return d if self.kind == "int8" else d // 2

    @property
    def label(self) -> str:
        if self.kind == "mlx":
            return f"int{self.bits} (mlx, groups of {self.group})"
        if self.kind == "int8":
            return "int8 (bitsandbytes)"
        return f"{self.kind} (bitsandbytes, blocks of {self.group})"

    def part_ranges(self, row: int) -> list[tuple[str, int, int]]:
        """(tensor, first byte from the tensor's start, bytes) of what scales row `row`."""
        v, d = self.shape
        if self.kind == "mlx":
            return [(t.name, row * t.row_bytes, t.row_bytes) for t in self.parts.values()]
        if self.kind == "int8":
            t = self.parts["SCB"]
            size = t.nbytes // max(1, v)
            return [(t.name, row * size, size)]
        absmax = self.parts["absmax"]
        size = absmax.nbytes // max(1, absmax.numel)
        first, last = row * d // self.group, ((row + 1) * d - 1) // self.group
        return [(absmax.name, first * size, (last - first + 1) * size)]


def find_packed(ckpt: Checkpoint, quant: Any, name: str) -> Packed | None:
    """The packed table `name` as MLX or bitsandbytes stores it; None for another layout."""
    tensors = ckpt.tensors
    weight = tensors[name]
    module = name.removesuffix(".weight")
    if weight.dtype == "U32" and len(weight.shape) == 2 and isinstance(quant, dict):
        settings = mlx_settings(module, quant)
        scales, biases = tensors.get(module + ".scales"), tensors.get(module + ".biases")
        if settings is None or scales is None or biases is None:
            return None
        bits, group = settings
        d = weight.shape[1] * 32 // bits
        if 32 % bits or d % group or scales.shape != (weight.shape[0], d // group):
            return None
        parts = {"scales": scales, "biases": biases}
        return Packed("mlx", (weight.shape[0], d), weight, parts, bits, group)
    scb = tensors.get(module + ".SCB")
    if weight.dtype == "I8" and len(weight.shape) == 2 and scb is not None:
        return Packed("int8", (weight.shape[0], weight.shape[1]), weight, {"SCB": scb}, 8, 0)
    if weight.dtype == "U8" and name + ".absmax" in tensors:
        return _bnb_4bit(tensors, name, weight)
    return None


def _bnb_4bit(tensors: dict[str, TensorEntry], name: str, weight: TensorEntry) -> Packed | None:
    """bitsandbytes' 4-bit table, from its state JSON (which must be on disk)."""
    entry = next((t for n, t in tensors.items() if n.startswith(name + ".quant_state.")), None)
    raw = None if entry is None else small_tensor_bytes(entry, limit=1 << 16)
    try:
        state = json.loads(raw.decode("utf-8")) if raw else None
    except ValueError:
        state = None
    if not isinstance(state, dict):
        return None
    shape, block = state.get("shape"), state.get("blocksize")
    if not (isinstance(shape, list) and len(shape) == 2 and isinstance(block, int) and block > 0):
        return None
    v, d = shape
    if d % 2 or v * d != weight.numel * 2 or state.get("quant_type") not in ("nf4", "fp4"):
        return None
    roles = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
    parts = {r: tensors[f"{name}.{r}"] for r in roles if f"{name}.{r}" in tensors}
    if "quant_map" not in parts:
        return None
    return Packed(str(state["quant_type"]), (v, d), weight, parts, 4, block, state)


def mlx_values(
    words: npt.NDArray[np.uint32],
    scales: npt.NDArray[np.float32],
    biases: npt.NDArray[np.float32],
    bits: int,
    group: int,
) -> npt.NDArray[np.float32]:
    """MLX rows (bits of 2, 4 or 8: 32 / bits values a word, lowest bits first): q * scale + bias
    per group."""
    import numpy as np

    n, groups = scales.shape
    d = groups * group
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    q = (words[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)
    grouped = q.reshape(n, groups, group).astype(np.float32)
    out = grouped * scales[:, :, None] + biases[:, :, None]
    return out.reshape(n, d)


def bnb_4bit_values(
    packed: npt.NDArray[np.uint8],
    code: npt.NDArray[np.float32],
    absmax: npt.NDArray[np.float32],
    firsts: npt.NDArray[np.int64],
    block: int,
    dtype: str,
) -> npt.NDArray[np.float32]:
    """bitsandbytes 4-bit rows (two values a byte, high nibble first), each row's first element
    at `firsts` in the flattened tensor: code[q] * absmax[element // block], rounded to
    `dtype`."""
    import numpy as np

    n, half = packed.shape
    q = np.empty((n, 2 * half), np.uint8)
    q[:, 0::2] = packed >> 4
    q[:, 1::2] = packed & 0xF
    index = (firsts[:, None] + np.arange(2 * half)) // block
    return round_to(code[q] * absmax[index], dtype)


def round_to(values: npt.NDArray[np.float32], dtype: str) -> npt.NDArray[np.float32]:
    """float32 values rounded to float16 or bfloat16 (to nearest, ties to even), as float32."""
    import numpy as np

    if dtype == "float16":
        return values.astype(np.float16).astype(np.float32)
    if dtype != "bfloat16":
        return values
    u = values.view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) & np.uint32(0xFFFF0000)
    return np.where(np.isnan(values), values, rounded.view(np.float32))
