"""One reader per quantised layout: from tensor names, dtypes and shapes (and the config's bits),
the logical shape of each packed weight and the bookkeeping tensors that serve it.

Each reader takes the tensors not yet taken, marks what it reads in `taken`, and returns one
`Found` per parameter. The layouts, as their quantisers write them:

- MXFP4 (gpt-oss): `X_blocks` U8 [..., G, 16] (32 fp4 values in 16 bytes) and `X_scales` U8
  [..., G] (e8m0); the parameter is `X`, [..., G·32].
- compressed-tensors `pack-quantized`: `weight_packed` I32 [out, ⌈in·bits/32⌉] (32/bits values a
  word), `weight_shape` (the logical shape, as data), `weight_scale`, `weight_zero_point`,
  `weight_g_idx`; `nvfp4-pack-quantized`: `weight_packed` U8 (2 values a byte), `weight_scale`
  (fp8, a group of 16), `weight_global_scale`.
- GPTQ: `qweight` I32 [in·bits/32, out], packed along the input; AWQ: `qweight` I32
  [in, out·bits/32], packed along the output; both with `qzeros`, `scales` and GPTQ's `g_idx`.
- bitsandbytes 4-bit: `weight` U8 [n/2, 1] with `weight.absmax`, `weight.quant_map`,
  `weight.nested_*` and `weight.quant_state.bitsandbytes__nf4` (its JSON holds the shape);
  8-bit: `weight` I8 with `SCB` and `weight_format`.
- MLX: `weight` U32 [..., in·bits/32] with `scales` and `biases` [..., in/group].
- ModelOpt NVFP4: `weight` U8 [out, in/2], `weight_scale` fp8, `weight_scale_2`, `input_scale`.
- FP8 (DeepSeek-V3, Qwen3-FP8, compressed-tensors `float-quantized`, ModelOpt FP8): `weight`
  F8 with `weight_scale_inv` or `weight_scale` (per tensor, channel or block).
- compressed-tensors `int-quantized`: `weight` I8 (one value a byte, any bits) with
  `weight_scale` and `weight_zero_point`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from embedlens.io.checkpoint import TORCH_DTYPE_NAMES, TensorEntry
from embedlens.io.tensor_bytes import small_tensor_bytes
from embedlens.model.quant.config import ct_scheme, mlx_settings, plain_bits

Tensors = dict[str, TensorEntry]


@dataclass
class Ctx:
    """What every reader reads: the tensors, the config's settings, the names taken so far and
    the bookkeeping tensors stored beside each module (indexed once)."""

    tensors: Tensors
    quant: dict[str, Any]
    taken: set[str]
    beside: dict[str, list[tuple[str, TensorEntry]]]
    """Module name to (suffix, tensor) of each bookkeeping tensor stored beside its weight."""


def index_bookkeeping(tensors: Tensors) -> dict[str, list[tuple[str, TensorEntry]]]:
    """Every tensor whose name ends with a bookkeeping suffix, by the module it serves."""
    out: dict[str, list[tuple[str, TensorEntry]]] = {}
    for name, t in tensors.items():
        head, _, last = name.rpartition(".")
        if last in _KINDS:
            out.setdefault(head, []).append((last, t))
            continue
        module, _, mid = head.rpartition(".")
        if f"{mid}.{last}" in _KINDS:
            out.setdefault(module, []).append((f"{mid}.{last}", t))
    return out


@dataclass(frozen=True)
class Found:
    """One quantised parameter: its name, logical shape, stored values, bookkeeping, and what
    it holds."""

    name: str
    shape: tuple[int, ...]
    values: list[TensorEntry]
    book: list[tuple[TensorEntry, str]]
    label: str


# Bookkeeping tensors by the suffix after the module's name, and what each is.
_KINDS = {
    "weight_scale_inv": "scales", "weight_scale": "scales", "scales": "scales",
    "weight.absmax": "scales", "weight.nested_absmax": "scales", "SCB": "scales",
    "weight_zero_point": "zero points", "qzeros": "zero points", "biases": "zero points",
    "g_idx": "indices", "weight_g_idx": "indices",
    "weight_global_scale": "global scales", "weight_scale_2": "global scales",
    "input_global_scale": "activation scales", "input_scale": "activation scales",
    "input_zero_point": "activation scales", "output_scale": "activation scales",
    "k_scale": "activation scales", "v_scale": "activation scales",
    "weight_shape": "state", "weight.quant_map": "state", "weight.nested_quant_map": "state",
    "weight_format": "state",
}  # fmt: skip
_STATE_PREFIX = "quant_state."


def _name(dtype: str) -> str:
    return {"F8_E8M0": "e8m0"}.get(dtype, TORCH_DTYPE_NAMES.get(dtype, dtype.lower()))


def _attached(ctx: Ctx, module: str) -> list[tuple[TensorEntry, str]]:
    """The bookkeeping tensors stored beside a module's weight, marked taken."""
    out = []
    for suffix, t in ctx.beside.get(module, ()):
        if t.name not in ctx.taken:
            out.append((t, _KINDS[suffix]))
            ctx.taken.add(t.name)
    return out


def _scale_words(book: list[tuple[TensorEntry, str]], shape: tuple[int, ...]) -> str:
    """' + bfloat16 block scales': the scales' dtype and how they cover the weight."""
    scale, biases = None, False
    for t, kind in book:
        if kind == "scales" and scale is None:
            scale = t
        biases = biases or t.name.endswith(".biases")
    return "" if scale is None else _words(scale.dtype, scale.shape, shape, biases)


@lru_cache(maxsize=4096)
def _words(dtype: str, scale: tuple[int, ...], shape: tuple[int, ...], biases: bool) -> str:
    n = 1
    for d in scale:
        n *= d
    if n == 1:
        how = "tensor scale"
    elif len(shape) >= 2 and len(scale) >= 2 and 1 < scale[-2] < shape[-2]:
        how = "block scales"
    elif n == (shape[-2] if len(shape) >= 2 else 1):
        how = "channel scales"
    else:
        how = "group scales"
    return f" + {_name(dtype)} {how}{' and biases' if biases else ''}"


def _found(
    name: str,
    shape: tuple[int, ...],
    values: list[TensorEntry],
    book: list[tuple[TensorEntry, str]],
    what: str,
) -> Found:
    return Found(name, shape, values, book, what + _scale_words(book, shape))


def mxfp4(ctx: Ctx) -> list[Found]:
    """gpt-oss's MXFP4 experts: `X_blocks` and `X_scales`."""
    tensors, taken = ctx.tensors, ctx.taken
    out = []
    for name, t in tensors.items():
        if not name.endswith("_blocks") or name in taken or len(t.shape) < 2 or t.dtype != "U8":
            continue
        base = name.removesuffix("_blocks")
        scales = tensors.get(base + "_scales")
        if scales is None or scales.shape != t.shape[:-1]:
            continue
        taken.update({name, scales.name})
        shape = (*t.shape[:-2], t.shape[-2] * t.shape[-1] * 2)
        out.append(Found(base, shape, [t], [(scales, "scales")], "mxfp4 + e8m0 scales"))
    return out


def _logical_shape(t: TensorEntry, per: int, stored: TensorEntry | None) -> tuple[int, ...]:
    """A packed weight's shape: its `weight_shape` where its bytes are on disk and fit, else the
    packed width times the values a word holds."""
    shape = (*t.shape[:-1], t.shape[-1] * per)
    raw = small_tensor_bytes(stored) if stored is not None else None
    if raw is None or stored is None or stored.dtype not in ("I32", "I64"):
        return shape
    width = 8 if stored.dtype == "I64" else 4
    said = tuple(
        int.from_bytes(raw[i : i + width], "little", signed=True) for i in range(0, len(raw), width)
    )
    fits = len(said) == len(shape) and said[:-1] == shape[:-1]
    return said if fits and shape[-1] - per < said[-1] <= shape[-1] else shape


def ct_packed(ctx: Ctx) -> list[Found]:
    """compressed-tensors' `weight_packed` (pack-quantized, nvfp4-pack-quantized)."""
    tensors, quant, taken = ctx.tensors, ctx.quant, ctx.taken
    out = []
    for name, t in tensors.items():
        if not name.endswith(".weight_packed") or name in taken or not t.shape:
            continue
        module = name.removesuffix(".weight_packed")
        scheme = ct_scheme(module, quant) or {}
        bits = scheme.get("num_bits")
        fmt = str(scheme.get("format") or "pack-quantized")
        if t.dtype == "U8":
            per = 8 // (bits if bits in (4, 2, 1) else 4)
            what = "mxfp4" if fmt.startswith("mxfp4") else "nvfp4"
            if scheme.get("type") == "int":
                what = f"int{bits}"
        elif t.dtype == "I32" and isinstance(bits, int) and bits in (1, 2, 4, 8, 16):
            per, what = 32 // bits, f"int{bits}"
        else:
            continue
        stored = tensors.get(module + ".weight_shape")
        shape = _logical_shape(t, per, stored)
        taken.add(name)
        book = _attached(ctx, module)
        out.append(_found(module + ".weight", shape, [t], book, f"{what} ({fmt})"))
    return out


def gptq_awq(ctx: Ctx) -> list[Found]:
    """GPTQ and AWQ: `qweight` with `scales`, `qzeros` and GPTQ's `g_idx` (any bits: GPTQ's
    3-bit words hold values across their boundaries, so its rows are in·bits/32)."""
    tensors, quant, taken = ctx.tensors, ctx.quant, ctx.taken
    out = []
    bits = plain_bits(quant)
    method = str(quant.get("quant_method") or "").lower()
    for name, t in tensors.items():
        if not name.endswith(".qweight") or name in taken or len(t.shape) != 2 or not bits:
            continue
        if t.dtype not in ("I32", "U32"):
            continue
        module = name.removesuffix(".qweight")
        scales, g_idx = tensors.get(module + ".scales"), tensors.get(module + ".g_idx")
        awq = method == "awq" or (
            method != "gptq" and scales is not None and scales.shape[-1] != t.shape[1]
        )
        if awq:
            rows, cols = t.shape[1] * 32 // bits, t.shape[0]
        else:
            rows = t.shape[1]
            cols = g_idx.shape[0] if g_idx is not None and g_idx.shape else t.shape[0] * 32 // bits
        taken.add(name)
        book = _attached(ctx, module)
        what = f"int{bits} ({'awq' if awq else 'gptq'})"
        out.append(_found(module + ".weight", (rows, cols), [t], book, what))
    return out


def _bnb_shape(state: TensorEntry | None) -> tuple[int, ...] | None:
    """The shape bitsandbytes' packed quant_state JSON holds, where its bytes are on disk."""
    raw = small_tensor_bytes(state, limit=1 << 16) if state is not None else None
    try:
        shape = json.loads(raw.decode("utf-8"))["shape"] if raw else None
    except (ValueError, KeyError, TypeError):
        return None
    if isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape):
        return tuple(shape)
    return None


def bnb(ctx: Ctx) -> list[Found]:
    """bitsandbytes: 4-bit (`weight.absmax`, `weight.quant_state.*`) and 8-bit (`SCB`)."""
    tensors, taken = ctx.tensors, ctx.taken
    out = []
    states: dict[str, list[TensorEntry]] = {}
    for name, t in tensors.items():  # bitsandbytes' packed state, by the weight it serves
        weight, sep, _ = name.partition("." + _STATE_PREFIX)
        if sep:
            states.setdefault(weight, []).append(t)
    for name, t in tensors.items():
        if not name.endswith(".weight") or name in taken:
            continue
        module = name.removesuffix(".weight")
        kept = states.get(name, [])
        state = next(
            ((s, s.name.rsplit("__", 1)[-1]) for s in kept if "bitsandbytes__" in s.name), None
        )
        if t.dtype == "U8" and (state is not None or f"{name}.absmax" in tensors):
            kind = state[1] if state is not None else "4-bit"
            shape = _bnb_shape(state[0] if state else None) or (t.numel * 2,)
            if not t.numel * 2 - 1 <= _numel(shape) <= t.numel * 2:
                shape = (t.numel * 2,)
            what = f"{kind} (bitsandbytes)"
        elif t.dtype == "I8" and f"{module}.SCB" in tensors:
            shape, what = t.shape, "int8 (bitsandbytes)"
        else:
            continue
        taken.add(name)
        book = _attached(ctx, module)
        book += [(s, "state") for s in kept if s.name not in taken]
        taken.update(s.name for s in kept)
        out.append(_found(name, shape, [t], book, what))
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def mlx(ctx: Ctx) -> list[Found]:
    """MLX: `weight` U32 with `scales` (and `biases`), bits and group size from the config."""
    tensors, quant, taken = ctx.tensors, ctx.quant, ctx.taken
    out = []
    for name, t in tensors.items():
        if not name.endswith(".weight") or name in taken or t.dtype != "U32" or not t.shape:
            continue
        module = name.removesuffix(".weight")
        if module + ".scales" not in tensors:
            continue
        settings = mlx_settings(module, quant)
        if settings is None or 32 % settings[0]:
            continue
        bits, group = settings
        taken.add(name)
        shape = (*t.shape[:-1], t.shape[-1] * 32 // bits)
        book = _attached(ctx, module)
        out.append(_found(name, shape, [t], book, f"int{bits} (mlx, groups of {group})"))
    return out


def modelopt_nvfp4(ctx: Ctx) -> list[Found]:
    """ModelOpt's NVFP4: `weight` U8 (two fp4 values a byte) with fp8 `weight_scale` and
    `weight_scale_2`."""
    tensors, taken = ctx.tensors, ctx.taken
    out = []
    for name, t in tensors.items():
        if not name.endswith(".weight") or name in taken or t.dtype != "U8" or not t.shape:
            continue
        module = name.removesuffix(".weight")
        scale = tensors.get(module + ".weight_scale")
        if (
            scale is None
            or not scale.dtype.startswith("F8")
            or module + ".weight_scale_2" not in (tensors)
        ):
            continue
        taken.add(name)
        shape = (*t.shape[:-1], t.shape[-1] * 2)
        book = _attached(ctx, module)
        out.append(_found(name, shape, [t], book, "nvfp4 (modelopt)"))
    return out


def fp8(ctx: Ctx) -> list[Found]:
    """FP8 weights with their scales (`weight_scale_inv`, `weight_scale`)."""
    tensors, taken = ctx.tensors, ctx.taken
    out = []
    for name, t in tensors.items():
        if not name.endswith("weight") or name in taken or not t.dtype.startswith("F8_E"):
            continue
        if t.dtype == "F8_E8M0":
            continue
        module = name.removesuffix(".weight") if name.endswith(".weight") else name
        taken.add(name)
        book = _attached(ctx, module) if name.endswith(".weight") else []
        found = _found(name, t.shape, [t], book, _name(t.dtype))
        scheme = ct_scheme(module, ctx.quant) or {}
        if ctx.quant.get("weight_block_size") or scheme.get("strategy") == "block":
            # one block covers a small weight whole: its one scale is still a block's
            found = replace(found, label=found.label.replace("tensor scale", "block scales"))
        out.append(found)
    return out


def ct_int(ctx: Ctx) -> list[Found]:
    """compressed-tensors' int-quantized: `weight` I8 with `weight_scale`."""
    tensors, quant, taken = ctx.tensors, ctx.quant, ctx.taken
    out = []
    for name, t in tensors.items():
        if not name.endswith(".weight") or name in taken or t.dtype not in ("I8", "I16"):
            continue
        module = name.removesuffix(".weight")
        if module + ".weight_scale" not in tensors:
            continue
        scheme = ct_scheme(module, quant) or {}
        bits = scheme.get("num_bits") or 8
        taken.add(name)
        book = _attached(ctx, module)
        out.append(_found(name, t.shape, [t], book, f"int{bits} (int-quantized)"))
    return out


FORMATS: tuple[tuple[str, Callable[[Ctx], list[Found]]], ...] = (
    ("mxfp4", mxfp4),
    ("compressed-tensors packed", ct_packed),
    ("gptq/awq", gptq_awq),
    ("bitsandbytes", bnb),
    ("mlx", mlx),
    ("modelopt nvfp4", modelopt_nvfp4),
    ("fp8", fp8),
    ("int-quantized", ct_int),
)
"""The readers, in the order they take tensors (the most specific layouts first)."""


def loose(tensors: Tensors, taken: set[str]) -> list[tuple[TensorEntry, str]]:
    """Activation and KV-cache scales stored beside no quantised weight (`k_scale`,
    `input_scale` of a module whose weight is kept in full precision), marked taken."""
    out = []
    for name, t in tensors.items():
        suffix = name.rsplit(".", 1)[-1]
        if name not in taken and _KINDS.get(suffix) == "activation scales":
            taken.add(name)
            out.append((t, "activation scales"))
    return out
