"""The tuned lens as a decoder: a learned affine translator per layer, then the model's own tail.

A residual h read at layer l < L becomes h + W_l h + b_l (tuned-lens's `transform_hidden`: the
translator is added residually, so weight decay pulls it toward the identity), and the model's
own decoder (`ModelDecoder`: final norm, head, post-head steps) turns it into logits. The last
layer L has no translator: it decodes as the model does, so the engine's self-check still holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from embedlens.analysis.lens.blocks import Capture, Decoder
from embedlens.errors import UsageError


@dataclass(frozen=True)
class Translators:
    """One affine translator per layer 0..L-1: weight [L, d, d] and bias [L, d], float32."""

    weight: torch.Tensor
    bias: torch.Tensor
    num_layers: int = field(init=False, compare=False, repr=False)
    """L: the layers with a translator (the model's blocks)."""
    width: int = field(init=False, compare=False, repr=False)
    """d: the residual stream's width."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_layers", int(self.weight.shape[0]))
        object.__setattr__(self, "width", int(self.weight.shape[1]))

    @classmethod
    def identity(cls, num_layers: int, width: int) -> Translators:
        """Translators that change nothing (W = 0, b = 0): the logit lens."""
        weight = torch.zeros(num_layers, width, width, dtype=torch.float32)
        return cls(weight, torch.zeros(num_layers, width, dtype=torch.float32))

    def apply(self, rows: torch.Tensor, layers: Sequence[int]) -> torch.Tensor:
        """Rows [n, d] translated, row i by the translator of layers[i] (none at layer L), in
        float32: h + W h + b."""
        if rows.shape[-1] != self.width:
            raise UsageError(
                f"the tuned lens's translators are {self.width} wide; this model's residual "
                f"stream is {rows.shape[-1]} wide: the lens was tuned for another model"
            )
        h = rows.float()
        out = h.clone()
        at = torch.tensor(list(layers), dtype=torch.long)
        for layer in sorted({int(x) for x in layers if 0 <= x < self.num_layers}):
            pick = (at == layer).nonzero().flatten().to(h.device)
            x = h.index_select(0, pick)
            w = self.weight[layer].to(h.device)
            b = self.bias[layer].to(h.device)
            out.index_copy_(0, pick, x + torch.addmm(b, x, w.T))
        return out


class TunedDecoder:
    """Translator, then the model's own decoder: the tuned lens (the last layer untranslated)."""

    def __init__(self, own: Decoder, translators: Translators) -> None:
        self.own = own
        self.translators = translators

    @property
    def full(self) -> bool:
        """The model's own decoder's flag (its tail ran with every block in place)."""
        return self.own.full

    @full.setter
    def full(self, value: bool) -> None:
        self.own.full = value

    def logits(self, rows: torch.Tensor, layers: Sequence[int]) -> torch.Tensor:
        """Logits [n, V] of rows [n, d], each translated for the layer it was read at."""
        translated = self.translators.apply(rows, layers)
        return self.own.logits(translated.to(rows.dtype), layers)

    def watch(self, cap: Capture) -> list[Any]:
        """The model's own decoder's hooks on the head."""
        return self.own.watch(cap)

    def steps(self, row: torch.Tensor, tol: float) -> list[str]:
        """What runs after the last block (the last layer is decoded untranslated)."""
        return self.own.steps(row, tol)

    def suspect(self, real: Capture, tol: float) -> str:
        """The model's own decoder's suspect step (the last layer has no translator)."""
        return self.own.suspect(real, tol)
