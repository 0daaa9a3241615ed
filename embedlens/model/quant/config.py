"""What a quantization_config says about one module: its bits, its group size, whether it is left
out. Read as the quantisers write it (compressed-tensors' `config_groups` with `targets` and
`ignore`; GPTQ's and AWQ's `bits`; bitsandbytes' `load_in_4bit`; MLX's `quantization`)."""

from __future__ import annotations

import re
from typing import Any

CT_PACKED = ("pack-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized")


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def matches(module: str, target: str) -> bool:
    """compressed-tensors' rule: 're:' a regular expression matched against the module's name;
    otherwise a layer's name (its end) or a class name (a capitalised word: any Linear here,
    as header names carry no class)."""
    if target.startswith("re:"):
        pattern = target[3:]
        return re.match(pattern, module) is not None or re.match(pattern, module + ".") is not None
    if target[:1].isupper() and "." not in target:
        return True
    return module == target or module.endswith("." + target)


def ignored(module: str, quant: dict[str, Any]) -> bool:
    """Whether the config leaves this module unquantised (`ignore`, `modules_to_not_convert`)."""
    for key in ("ignore", "modules_to_not_convert", "exclude_modules"):
        listed = quant.get(key)
        if isinstance(listed, list) and any(
            isinstance(t, str)
            and (matches(module, t) if t.startswith("re:") else _named(module, t))
            for t in listed
        ):
            return True
    return False


def _named(module: str, target: str) -> bool:
    target = target.rstrip("*").rstrip(".")
    return module == target or module.endswith("." + target) or module.startswith(target + ".")


def ct_scheme(module: str, quant: dict[str, Any]) -> dict[str, Any] | None:
    """The compressed-tensors scheme (`weights` of a config group, with the group's `format`)
    that covers a module: a group whose regular expression names it first, then one whose
    targets name its class; None where none does or `ignore` leaves it out."""
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or ignored(module, quant):
        return None
    by_name, by_class = None, None
    for group in groups.values():
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            continue
        targets = [t for t in group.get("targets") or [] if isinstance(t, str)]
        scheme = {**group["weights"], "format": group.get("format") or quant.get("format")}
        for t in targets:
            if t[:1].isupper() and "." not in t:
                by_class = by_class or scheme
            elif matches(module, t):
                by_name = by_name or scheme
    return by_name or by_class


def plain_bits(quant: dict[str, Any]) -> int | None:
    """GPTQ's and AWQ's `bits` (AutoAWQ's `w_bit`)."""
    return _int(quant.get("bits")) or _int(quant.get("w_bit"))


def mlx_settings(module: str, quant: dict[str, Any]) -> tuple[int, int] | None:
    """(bits, group size) of an MLX module: its own entry where the config has one, else the
    model's; None where its entry says it is not quantised."""
    own = quant.get(module)
    if own is False:
        return None
    source = own if isinstance(own, dict) else quant
    bits, group = _int(source.get("bits")), _int(source.get("group_size"))
    if bits is None:
        return None
    return bits, group or 64
