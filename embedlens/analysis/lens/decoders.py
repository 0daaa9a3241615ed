"""The decoders: what turns a residual vector read at a layer into logits.

`LogitLens` decodes through the model's own tail (`blocks.ModelDecoder`: final norm, head,
post-head steps, as the model wrote them). `TunedLens` first applies a learned affine translator
per layer: a residual h read at layer l < L becomes h + W_l h + b_l (tuned-lens's
`transform_hidden`: the translator is added residually, so weight decay pulls it toward the
identity), then the model's own tail; the last layer L has no translator, so the engine's
self-check still holds. Both are public objects that work on a caller's own tensors, as
tuned-lens's `LogitLens` and `TunedLens` do; the lens engine runs the same decoders (`Decoder`).
A lens folder (`tuned_folder`) is checked against the model's config before its weights load
(`tuned_folder.fits_tuned`), then against the loaded model (`tuned_through`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from embedlens.analysis.lens.blocks import Capture, Decoder, ModelDecoder, find_blocks
from embedlens.errors import UsageError

if TYPE_CHECKING:
    from torch import nn

    from embedlens.analysis.lens.opening import Opened, Prompt
    from embedlens.analysis.lens.tuned_folder import LensFolder
    from embedlens.reports.tune import TunedLens as TunedDescription


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


class LogitLens:
    """The logit lens as an object: `LogitLens.from_model(model)(hidden, layer)` decodes a
    residual `hidden` [..., d] read at `layer` (0: the embedding output, i: block i's output)
    through the model's own tail, into float32 logits [..., V]: the `lens` report's figures."""

    def __init__(self, model: nn.Module, decoder: Decoder) -> None:
        self.model = model
        self.decoder = decoder
        self.num_layers = len(find_blocks(model).modules)
        """L: the model's blocks; layers 0..L can be decoded."""

    @classmethod
    def from_model(cls, model: nn.Module, *, dummy_id: int = 0) -> LogitLens:
        """The logit lens of a loaded transformers causal LM (`dummy_id`: the token the tail's
        forward pass runs on, whose embedding is replaced; any id gives the same logits)."""
        return cls(model, ModelDecoder(model, find_blocks(model), dummy_id=dummy_id))

    def __call__(self, hidden: torch.Tensor, layer: int) -> torch.Tensor:
        """Float32 logits [..., V] of residual vectors [..., d] read at `layer`."""
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise UsageError(f"layer must be an int, not {type(layer).__name__}")
        if not 0 <= layer <= self.num_layers:
            raise UsageError(f"layer {layer} is not in 0..{self.num_layers} (the model's blocks)")
        rows = hidden.reshape(-1, hidden.shape[-1])
        with torch.no_grad():
            out = self.decoder.logits(rows, [layer] * rows.shape[0]).float()
        return out.reshape(*hidden.shape[:-1], out.shape[-1])


class TunedLens(LogitLens):
    """The tuned lens as an object: `TunedLens.from_folder(model, folder)(hidden, layer)`, a
    residual [..., d] at `layer` translated, then decoded by the model's own tail."""

    @classmethod
    def from_folder(
        cls, model: nn.Module, folder: str | os.PathLike[str], *, tokenizer: Any = None
    ) -> TunedLens:
        """The tuned lens in `folder` (`embedlens tune`'s, or one tuned-lens saved) on `model`,
        refused for another model (its size, its decoder's weights, and with `tokenizer` its
        vocabulary, as `lens --tuned` checks them)."""
        from embedlens.analysis.lens.tuned_folder import fits_tuned

        lens = open_tuned(folder)
        fits_tuned(lens, getattr(model, "config", None))
        through = tuned_through(lens, model, tokenizer)
        own = ModelDecoder(model, find_blocks(model), dummy_id=0)
        return cls(model, through.wrap(own))


Wrap = Callable[[Decoder], Decoder]
"""Builds the lens's decoder on the model's own."""


@dataclass(frozen=True)
class Through:
    """The tuned lens ready for the engine: its decoder maker, and what reports say of it."""

    wrap: Wrap
    """Builds the tuned lens's decoder on the model's own."""
    described: TunedDescription
    """What reports say of the lens (their `tuned`)."""


def open_tuned(path: str | os.PathLike[str]) -> LensFolder:
    """The lens folder, its config and tensors' shapes checked (no torch)."""
    from embedlens.analysis.lens.tuned_folder import open_folder

    return open_folder(path)


def tuned_through(
    lens: LensFolder, model: nn.Module, tokenizer: Any, *, fingerprints: bool = True
) -> Through:
    """The decoder maker and the report's description of the lens, once the lens is checked
    against the loaded model (its blocks, its decoder's weights, its vocabulary: without a
    `tokenizer`, not that; without `fingerprints`, its blocks alone: the model compared with
    the one the lens was tuned on, read through that model's lens)."""
    from embedlens.analysis.lens.tuned_folder import check_model
    from embedlens.reports.tune import TunedLens as Described

    check_model(lens, model, find_blocks(model), tokenizer, fingerprints=fingerprints)
    translators = load_translators(lens)

    def wrap(own: Decoder) -> Decoder:
        return TunedDecoder(own, translators)

    described = Described(
        path=str(lens.path),
        made_by=lens.made_by,
        base_model=lens.base_model,
        num_layers=lens.num_layers,
    )
    return Through(wrap, described)


def load_translators(lens: LensFolder) -> Translators:
    """The lens folder's translators (`tuned_folder.read_translators`)."""
    from embedlens.analysis.lens.tuned_folder import read_translators

    return Translators(*read_translators(lens))


def through_of(
    tuned: LensFolder | None, opened: Opened, *, fingerprints: bool = True
) -> Through | None:
    """The tuned lens as a decoder maker for `opened` (None without a lens): checked against the
    model (without `fingerprints`: its blocks alone, the lens being the other model's)."""
    if tuned is None:
        return None
    return tuned_through(tuned, opened.model, opened.tokenizer, fingerprints=fingerprints)


def tuned_decoder(
    tuned: LensFolder | None, opened: Opened, run: Prompt, *, fingerprints: bool = True
) -> tuple[Decoder | None, TunedDescription | None]:
    """The tuned lens's decoder on `opened`'s own for one prompt, and what reports say of the
    lens (None without one), as `through_of` checks it."""
    through = through_of(tuned, opened, fingerprints=fingerprints)
    if through is None:
        return None, None
    model = opened.model
    own = ModelDecoder(model, find_blocks(model), dummy_id=run.ids[0])
    return through.wrap(own), through.described
