"""The parts of a checkpoint its config's figures leave out or hide, for `params`: MTP layers
stored past `num_hidden_layers`, vision and audio towers beside the language model, routed and
shared experts."""

from __future__ import annotations

import re
from collections.abc import Sequence

from embedlens.model.anatomy import Placement, tower
from embedlens.model.inventory import Inventory
from embedlens.reports.params import PartRow

Entry = tuple[int, int | None, str | None]
_MTP = re.compile(r"(?:^|\.)(?:mtp|mtp_layers|nextn)(?:\.|_|$)")
_SHARED = re.compile(r"(?:^|\.)shared_experts?(?:\.|_|$)")


def _is_mtp(inv: Inventory, name: str, p: Placement) -> bool:
    """A multi-token-prediction tensor: of a block past the config's layer count (DeepSeek-V3's
    layer 61), or named for MTP."""
    layers = inv.config.num_layers
    if p.role == "blocks" and p.layer is not None and layers and p.layer >= layers:
        return True
    return _MTP.search(name) is not None


def main_model(inv: Inventory, placed: Sequence[tuple[Placement, Entry]]) -> tuple[int, int]:
    """(parameters of the model a token runs through, of which routed experts): MTP layers
    left out."""
    total = experts = 0
    for item, (p, e) in zip(inv.items, placed, strict=True):
        if _is_mtp(inv, item.name, p):
            continue
        total += e[0]
        if p.role == "blocks" and p.part == "experts":
            experts += e[0]
    return total, experts


def parts_of(
    inv: Inventory, placed: Sequence[tuple[Placement, Entry]], *, bytes_known: bool
) -> list[PartRow]:
    """One row per part present: mtp, vision, audio, routed experts, shared experts."""
    found: dict[str, list[Entry]] = {}
    for item, (p, e) in zip(inv.items, placed, strict=True):
        names = []
        if _is_mtp(inv, item.name, p):
            names.append("mtp")
        kind = tower(item.name)
        if kind is not None:
            names.append(kind)
        if p.role == "blocks" and p.part == "experts":
            names.append("routed experts")
        if _SHARED.search(item.name):
            names.append("shared experts")
        for name in names:
            found.setdefault(name, []).append(e)
    order = ("mtp", "vision", "audio", "routed experts", "shared experts")
    return [
        PartRow(
            name,
            sum(e[0] for e in found[name]),
            sum(e[1] or 0 for e in found[name]) if bytes_known else None,
        )
        for name in order
        if name in found
    ]
