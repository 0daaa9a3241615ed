"""A model built from its config, priced as its quantization_config stores it (`params
--meta-only`): the bytes of each quantised weight's values and of its bookkeeping, by the rules
the quantisers write by (the layouts of `formats.py`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from embedlens.model.quant.config import ct_scheme, ignored, mlx_settings, plain_bits

_SCALE_NAMES = {1: "float8_e4m3fn", 2: "bfloat16", 4: "float32"}


@dataclass(frozen=True)
class Priced:
    """One weight as its quantiser stores it."""

    nbytes: int
    """Bytes of its values."""
    book: tuple[tuple[str, int], ...]
    """(kind, bytes) of its bookkeeping."""
    label: str


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _int(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def method_of(quant: Any) -> str | None:
    """The quantiser as the config names it ('compressed-tensors', 'fp8', 'gptq', ...); 'mlx'
    for MLX's `quantization` (bits and group_size, no quant_method)."""
    if not isinstance(quant, dict):
        return None
    method = quant.get("quant_method")
    if isinstance(method, str):
        return method.lower()
    return "mlx" if "bits" in quant and "group_size" in quant else None


PRICEABLE = ("compressed-tensors", "fp8", "gptq", "awq", "bitsandbytes", "mxfp4", "mlx", "modelopt")


def price(
    name: str, shape: tuple[int, ...], kind: str, quant: dict[str, Any], base: int
) -> Priced | None:
    """How `name` is stored: None where the config leaves it at the model's dtype.

    kind: the module's class ('Linear', 'Embedding', 'Experts' for fused [E, out, in] experts,
        or '' for a parameter of another module);
    base: bytes of a value at the model's dtype (scales are often stored so).
    """
    method = method_of(quant)
    if method == "mxfp4":
        return _mxfp4(name, shape)
    if method == "mlx":
        return _mlx(name, shape, kind, quant, base)
    if kind == "Experts" and len(shape) == 3:  # fused experts: one Linear each, stacked
        one = price(name + ".weight", shape[1:], "Linear", quant, base)
        if one is None:
            return None
        e = shape[0]
        return Priced(one.nbytes * e, tuple((k, b * e) for k, b in one.book), one.label)
    if kind != "Linear" or len(shape) != 2 or not name.endswith(".weight"):
        return None
    module = name.removesuffix(".weight")
    if (module.endswith("lm_head") and method != "compressed-tensors") or ignored(module, quant):
        return None
    out, inn = shape
    if method == "compressed-tensors":
        return _compressed_tensors(module, out, inn, quant, base)
    if method == "fp8":
        block = quant.get("weight_block_size") or [128, 128]
        scales = _cdiv(out, block[0]) * _cdiv(inn, block[1]) * 4
        return Priced(out * inn, (("scales", scales),), "float8_e4m3fn + float32 block scales")
    if method in ("gptq", "awq"):
        return _gptq_awq(str(method), out, inn, quant)
    if method == "bitsandbytes":
        return _bnb(out, inn, quant)
    if method == "modelopt":
        return _modelopt(out, inn, quant)
    return None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _mxfp4(name: str, shape: tuple[int, ...]) -> Priced | None:
    """gpt-oss: the experts' projections, 32 values a block (16 bytes and an e8m0 scale)."""
    if len(shape) == 3 and name.endswith(("gate_up_proj", "down_proj")):
        n = _numel(shape)
        return Priced(n // 2, (("scales", n // 32),), "mxfp4 + e8m0 scales")
    return None


def _mlx(
    name: str, shape: tuple[int, ...], kind: str, quant: dict[str, Any], base: int
) -> Priced | None:
    """MLX: every Linear and Embedding whose rows divide into groups."""
    settings = mlx_settings(name.removesuffix(".weight"), quant)
    if kind not in ("Linear", "Embedding") or settings is None or not name.endswith("weight"):
        return None
    bits, group = settings
    if shape[-1] % group:
        return None
    n = _numel(shape)
    groups = n // group
    book = (("scales", groups * base), ("zero points", groups * base))
    label = f"int{bits} (mlx, groups of {group}) + {_SCALE_NAMES[base]} group scales and biases"
    return Priced(n * bits // 8, book, label)


def _modelopt(out: int, inn: int, quant: dict[str, Any]) -> Priced | None:
    """ModelOpt's FP8 (per-tensor scales) and NVFP4 (fp8 scales a group of 16, a global one)."""
    algo = str(quant.get("quant_algo") or "").upper()
    if algo == "FP8":
        per_tensor = (("scales", 4), ("activation scales", 4))
        return Priced(out * inn, per_tensor, "float8_e4m3fn + float32 tensor scale")
    if algo == "NVFP4":
        group = _int(quant.get("group_size"), 16)
        book = (("scales", out * _cdiv(inn, group)), ("global scales", 4), ("activation scales", 4))
        return Priced(out * inn // 2, book, "nvfp4 (modelopt) + float8_e4m3fn group scales")
    return None


def _compressed_tensors(
    module: str, out: int, inn: int, quant: dict[str, Any], base: int
) -> Priced | None:
    scheme = ct_scheme(module, quant)
    if scheme is None:
        return None
    bits = _int(scheme.get("num_bits"), 8)
    fmt = str(scheme.get("format") or "")
    strategy = str(scheme.get("strategy") or ("group" if scheme.get("group_size") else "tensor"))
    group = _int(scheme.get("group_size"), inn)
    if strategy == "channel":
        scales = out
    elif strategy in ("group", "tensor_group"):
        scales = out * _cdiv(inn, group)
    elif strategy == "block":
        bo, bi = scheme.get("block_structure") or [128, 128]
        scales = _cdiv(out, bo) * _cdiv(inn, bi)
    else:
        scales = 1
    book: list[tuple[str, int]] = []
    if fmt in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):
        values, scale_bytes = out * _cdiv(inn, 2), 1
        what = "nvfp4" if fmt.startswith("nvfp4") else "mxfp4"
    elif fmt == "pack-quantized":
        values, scale_bytes = out * _cdiv(inn, 32 // bits) * 4, base
        what = f"int{bits}"
        book.append(("state", 16))  # weight_shape: two int64
    else:
        values, scale_bytes = out * inn * _cdiv(bits, 8), base
        what = f"{scheme.get('type') or 'int'}{bits}"
        if what == "float8":  # as its headers say it: the values' dtype alone
            what, fmt = "float8_e4m3fn", ""
    book.append(("scales", scales * scale_bytes))
    if strategy == "tensor_group":
        book.append(("global scales", 4))
    if scheme.get("symmetric") is False:
        zeros = _cdiv(out, 32 // bits) * 4 * (scales // out or 1) if fmt == "pack-quantized" else 0
        book.append(("zero points", zeros or scales * base))
    how = {"channel": "channel scales", "block": "block scales", "tensor": "tensor scale"}
    label = f"{what}{f' ({fmt})' if fmt else ''} + {_SCALE_NAMES.get(scale_bytes, '?')} "
    return Priced(values, tuple(book), label + how.get(strategy, "group scales"))


def _gptq_awq(method: str, out: int, inn: int, quant: dict[str, Any]) -> Priced | None:
    """GPTQ packs bits·in/32 words a column (any bits: 3-bit values cross words), AWQ
    bits·out/32 a row; zero points packed along the output, float16 scales, GPTQ's g_idx."""
    bits = plain_bits(quant) or 4
    group = _int(quant.get("group_size") or quant.get("q_group_size"), -1)
    groups = _cdiv(inn, group) if group > 0 else 1
    zeros = groups * _cdiv(out * bits, 32) * 4
    book: tuple[tuple[str, int], ...] = (("scales", groups * out * 2), ("zero points", zeros))
    if method == "gptq":
        values = _cdiv(inn * bits, 32) * out * 4
        book = (*book, ("indices", inn * 4))
    else:
        values = inn * _cdiv(out * bits, 32) * 4
    return Priced(values, book, f"int{bits} ({method}) + float16 group scales")


def _bnb(out: int, inn: int, quant: dict[str, Any]) -> Priced | None:
    n = out * inn
    if quant.get("load_in_8bit"):
        return Priced(
            n, (("scales", out * 4), ("state", 1)), "int8 (bitsandbytes) + float32 scales"
        )
    if not quant.get("load_in_4bit"):
        return None
    blocks = _cdiv(n, 64)
    kind = str(quant.get("bnb_4bit_quant_type") or "fp4")
    # the packed state: quant_map (16 float32) and the JSON bitsandbytes writes beside it
    said = {"quant_type": kind, "blocksize": 64, "dtype": "bfloat16", "shape": [out, inn]}
    state = 64 + len(json.dumps(said))
    book: tuple[tuple[str, int], ...] = (("scales", blocks * 4), ("state", state))
    if quant.get("bnb_4bit_use_double_quant"):
        nested = {"nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 0.0}
        state += 1024 + len(json.dumps(nested))
        book = (("scales", blocks + _cdiv(blocks, 256) * 4), ("state", state))
    return Priced(_cdiv(n, 2), book, f"{kind} (bitsandbytes) + float32 absmax")
