"""One forward pass that keeps the residual stream: at each layer asked for, at the rows read.

Layer 0 is the first block's input (the embedding output), layer i block i's output. A batch of
prompts is padded on the right with an attention mask: in a causal model a real token never
attends to the padding after it, and its position ids are those of a single run. A single prompt
runs without a mask, as a plain call of the model does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from embedlens.analysis.lens.blocks import Blocks, first_tensor, forward, hooked, input_device
from embedlens.errors import UnsupportedError


@dataclass
class Capture:
    """What a forward pass leaves behind at the rows read: row r is (prompt bi[r], position pi[r])."""

    residual: dict[int, torch.Tensor]
    """layer -> [rows, d]."""
    logits: torch.Tensor | None = None
    """The model's own logits, float32 [rows, V]."""
    head_in: torch.Tensor | None = None
    """With a head watched: the head's input and output rows."""
    head_out: torch.Tensor | None = None
    steps: list[str] = field(default_factory=list)


Watch = Callable[[Capture], list[Any]]
"""Registers hooks that fill a capture's head_in and head_out (the decoder's `watch`)."""


def padded(
    prompts: Sequence[Sequence[int]], masked: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The prompts' ids as one [batch, longest] tensor padded on the right, and the attention
    mask (with `masked`; else None: one prompt, nothing padded)."""
    if not masked:
        assert len(prompts) == 1
        return torch.tensor([list(prompts[0])], dtype=torch.long), None
    width = max(len(ids) for ids in prompts)
    ids = torch.full((len(prompts), width), prompts[0][0], dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, row in enumerate(prompts):
        ids[b, : len(row)] = torch.tensor(list(row))
        mask[b, : len(row)] = 1
    return ids, mask


def capture(
    model: nn.Module,
    blocks: Blocks,
    prompts: Sequence[Sequence[int]],
    reads: Sequence[Sequence[int]],
    layers: Sequence[int],
    watch: Watch | None = None,
    *,
    masked: bool = True,
    logits: bool = True,
) -> Capture:
    """Run the model once on `prompts`, keeping the residual at each of `layers` and the logits
    at the positions `reads[b]` of each prompt b, in that order. `masked`: pass an attention mask
    (a batch); a single prompt may run without one (`masked=False`), as a plain call does.
    `logits=False`: the residual stream only (the head runs on one position; `logits` is None)."""
    device = input_device(model)
    ids, mask = padded(prompts, masked)
    bi = torch.tensor([b for b, read in enumerate(reads) for _ in read], dtype=torch.long)
    pi = torch.tensor([p for read in reads for p in read], dtype=torch.long)
    cap = Capture(residual={})

    def keep(layer: int) -> Callable[..., None]:
        def hook(_m: nn.Module, _args: Any, out: Any) -> None:
            t = first_tensor(out)
            if t is None:
                raise UnsupportedError(f"block {layer} returns no tensor the lens can read")
            cap.residual[layer] = t[bi.to(t.device), pi.to(t.device)].detach()

        return hook

    def keep_input(_m: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        t = first_tensor(args) if args else kwargs.get("hidden_states")
        if not isinstance(t, torch.Tensor):
            raise UnsupportedError("the first block's input is not a tensor the lens can read")
        cap.residual[0] = t[bi.to(t.device), pi.to(t.device)].detach()

    handles: list[Any] = []
    if 0 in layers:
        handles.append(blocks.modules[0].register_forward_pre_hook(keep_input, with_kwargs=True))
    for layer in sorted(set(layers) - {0}):
        handles.append(blocks.modules[layer - 1].register_forward_hook(keep(layer)))
    if watch is not None:
        handles += watch(cap)
    kept = torch.unique(pi) if logits else torch.unique(pi)[-1:]
    with hooked(handles):
        out = forward(model, ids.to(device), kept, None if mask is None else mask.to(device))
    for name in ("head_in", "head_out"):
        t = getattr(cap, name)
        if t is not None and t.shape[0] != len(kept):  # the model ignored logits_to_keep
            setattr(cap, name, t[kept.to(t.device)])
    if logits:
        at = torch.searchsorted(kept, pi)
        whole = len(prompts) == 1 and bool(torch.equal(at, torch.arange(out.shape[1])))
        # one prompt read at every position it kept, in order: its rows as they are (no copy)
        cap.logits = out[0] if whole else out[bi.to(out.device), at.to(out.device)]
        cap.logits = cap.logits.float()
    return cap
