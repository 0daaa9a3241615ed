"""The model as the lens sees it: its list of decoder blocks, where its input goes, one forward.

Generic by construction: the blocks are the model's ModuleList with as many entries as its config
says (the largest such), whatever the architecture names it.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from embedlens.errors import UnsupportedError


@dataclass(frozen=True)
class Blocks:
    """Where the decoder blocks live: parent.attr is the ModuleList."""

    parent: nn.Module
    attr: str
    modules: nn.ModuleList


def find_blocks(model: nn.Module) -> Blocks:
    """The ModuleList of decoder blocks: the largest one with as many entries as the config says."""
    root = model
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        try:
            found = get_decoder()
        except Exception:
            found = None
        if isinstance(found, nn.Module):
            root = found
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    expected = getattr(text, "num_hidden_layers", None)
    names = {id(m): n for n, m in model.named_modules()}
    candidates: list[tuple[bool, int, str, nn.ModuleList]] = []
    for name, module in root.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            size = sum(p.numel() for p in module.parameters())
            candidates.append((len(module) == expected, size, name, module))
    if not candidates:
        raise UnsupportedError(
            f"cannot find the decoder blocks of this model ({type(model).__name__})"
        )
    _, _, _, blocks = max(candidates, key=lambda c: (c[0], c[1]))
    full = names[id(blocks)]
    parent_name, _, attr = full.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    return Blocks(parent=parent, attr=attr, modules=blocks)


def first_tensor(value: Any) -> torch.Tensor | None:
    """A module's output tensor: the value itself, or the first item of a tuple or list."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def replace_first(value: Any, tensor: torch.Tensor) -> Any:
    """A module's output with its tensor (as `first_tensor` finds it) replaced."""
    if isinstance(value, torch.Tensor):
        return tensor
    if isinstance(value, tuple):
        return (tensor, *value[1:])
    if isinstance(value, list):
        return [tensor, *value[1:]]
    raise UnsupportedError(
        f"a decoder block returns {type(value).__name__}; the lens needs a tensor"
    )


def input_device(model: nn.Module) -> torch.device:
    """Where input ids go: the embedding's device (accelerate moves them on if it offloads)."""
    try:
        weight = model.get_input_embeddings().weight  # type: ignore[operator]
        device = weight.device
    except Exception:
        device = next(model.parameters()).device
    return torch.device("cpu") if device.type == "meta" else device


def forward(
    model: nn.Module,
    ids: torch.Tensor,
    keep: torch.Tensor | None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The model's logits, [batch, kept positions, V] (`keep`: the positions kept, all when None;
    `mask`: the attention mask of a padded batch)."""
    kwargs: dict[str, Any] = {"use_cache": False}
    if mask is not None:
        kwargs["attention_mask"] = mask
    params = inspect.signature(model.forward).parameters
    if keep is not None and "logits_to_keep" in params:
        kwargs["logits_to_keep"] = keep.to(ids.device)
    out = model(input_ids=ids, **kwargs)
    logits: torch.Tensor = out.logits if hasattr(out, "logits") else out[0]
    if keep is not None and "logits_to_keep" not in params:
        logits = logits[:, keep.to(logits.device)]
    return logits


@contextmanager
def hooked(handles: list[Any]) -> Iterator[None]:
    """The hooks `handles` stay registered inside the block, and are removed after it."""
    try:
        yield
    finally:
        for h in handles:
            h.remove()
