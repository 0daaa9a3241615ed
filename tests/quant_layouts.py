"""Checkpoints laid out as their quantisers write them, from a meta-device build of the config:
the safetensors headers written, the data left as holes (sparse files of the full size), so a
671B checkpoint costs a few megabytes of headers.

`meta_shapes` builds the model on the meta device with transformers (its parameters, and the
buffers a published checkpoint stores as tensors); `per_expert` splits fused 3-D experts into
the per-expert matrices published checkpoints hold; the `*_layout` functions turn each weight into
its stored tensors; `write_sparse` writes the shards and the index.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

Shape = tuple[int, ...]
Stored = list[tuple[str, str, Shape]]
BITS = {"F32": 32, "BF16": 16, "F16": 16, "F8_E4M3": 8, "U8": 8, "I8": 8, "I32": 32, "U32": 32,
        "I64": 64}  # fmt: skip


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def meta_shapes(config: dict, buffers: tuple[str, ...] = ()) -> dict[str, Shape]:
    """Parameter shapes of the model built from `config` on the meta device (and the buffers
    whose names end with one of `buffers`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = {k: v for k, v in config.items() if k not in ("auto_map", "quantization_config")}
    cfg = AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    shapes.update({n: tuple(b.shape) for n, b in model.named_buffers() if n.endswith(buffers)})
    return shapes


def per_expert(shapes: dict[str, Shape], *, transposed: bool = False) -> dict[str, Shape]:
    """Fused experts (`experts.gate_up_proj` [E, 2I, d], `experts.down_proj` [E, d, I]) as the
    per-expert matrices DeepSeek-style checkpoints store (`experts.{e}.gate_proj.weight`)."""
    out: dict[str, Shape] = {}
    for name, shape in shapes.items():
        if name.endswith("experts.gate_up_proj") and len(shape) == 3:
            e, rows, cols = shape if not transposed else (shape[0], shape[2], shape[1])
            base = name.removesuffix("gate_up_proj")
            for i in range(e):
                out[f"{base}{i}.gate_proj.weight"] = (rows // 2, cols)
                out[f"{base}{i}.up_proj.weight"] = (rows // 2, cols)
        elif name.endswith("experts.down_proj") and len(shape) == 3:
            e, rows, cols = shape if not transposed else (shape[0], shape[2], shape[1])
            for i in range(e):
                out[f"{name.removesuffix('down_proj')}{i}.down_proj.weight"] = (rows, cols)
        else:
            out[name] = shape
    return out


def plain(shapes: dict[str, Shape], dtype: str = "BF16") -> Stored:
    return [(n, dtype, s) for n, s in shapes.items()]


def fp8_block(name: str, shape: Shape) -> Stored:
    """DeepSeek-V3's FP8: e4m3 values and float32 `weight_scale_inv` per 128x128 block."""
    scale = (cdiv(shape[0], 128), cdiv(shape[1], 128))
    return [(name, "F8_E4M3", shape), (name + "_scale_inv", "F32", scale)]


def pack_quantized(bits: int, group: int) -> Callable[[str, Shape], Stored]:
    """compressed-tensors' pack-quantized: int32 words of 32/bits values, bfloat16 group
    scales, the logical shape as int64."""

    def lay(name: str, shape: Shape) -> Stored:
        module = name.removesuffix(".weight")
        out, inn = shape
        return [
            (module + ".weight_packed", "I32", (out, cdiv(inn, 32 // bits))),
            (module + ".weight_scale", "BF16", (out, cdiv(inn, group))),
            (module + ".weight_shape", "I64", (2,)),
        ]

    return lay


def quantise(
    shapes: dict[str, Shape],
    chosen: Callable[[str, Shape], bool],
    lay: Callable[[str, Shape], Stored],
) -> Stored:
    """Each chosen weight as `lay` stores it, the others in bfloat16."""
    out: Stored = []
    for name, shape in shapes.items():
        out.extend(lay(name, shape) if chosen(name, shape) else [(name, "BF16", shape)])
    return out


def mxfp4_experts(shapes: dict[str, Shape]) -> Stored:
    """gpt-oss: its experts' projections as MXFP4 blocks and scales (rows: the output), the rest
    in bfloat16. transformers' gpt-oss keeps gate_up_proj as [E, d, 2I] and down_proj as
    [E, I, d] (input first)."""
    out: Stored = []
    for name, shape in shapes.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, inn, rows = shape
            out.append((name + "_blocks", "U8", (e, rows, inn // 32, 16)))
            out.append((name + "_scales", "U8", (e, rows, inn // 32)))
        else:
            out.append((name, "BF16", shape))
    return out


def write_sparse(
    folder: Path,
    stored: Stored,
    config: dict,
    *,
    shards: int = 1,
    index_metadata: dict | None = None,
) -> int:
    """Write the checkpoint's shards as headers and holes, the index and config.json; return
    the bytes of all tensors."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    per = cdiv(len(stored), shards)
    weight_map: dict[str, str] = {}
    total = 0
    for k in range(shards):
        name = (
            "model.safetensors" if shards == 1 else f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        )
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for tname, dtype, shape in stored[k * per : (k + 1) * per]:
            size = numel(shape) * BITS[dtype] // 8
            header[tname] = {
                "dtype": dtype,
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
            weight_map[tname] = name
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(folder / name, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)) + raw)
            fh.truncate(8 + len(raw) + offset)
        total += offset
    if shards > 1:
        index = {
            "metadata": {"total_size": total, **(index_metadata or {})},
            "weight_map": weight_map,
        }
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return total
