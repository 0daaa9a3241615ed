"""The held-out evaluation: per layer, the logit lens and the tuned lens against the model.

For each held-out position and layer: KL(model's output ‖ lens) in nats, over the model's whole
softmax, at every position (what the refinement minimises); the cross-entropy of the next token
in nats, at every position that has one in its sequence (tuned-lens's `eval_loop`: the KL at the
token read, the cross-entropy shifted by one). Bits per byte are tuned-lens's conversion: nats
per token x (tokens / UTF-8 bytes of the held-out text) / ln 2. The last layer is the model's own
output (KL 0, the model's cross-entropy), for both lenses.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from embedlens.analysis.lens.blocks import Blocks, ModelDecoder, capture, input_device
from embedlens.analysis.lens.tuned import TunedDecoder
from embedlens.analysis.tune.data import Sequences
from embedlens.reports.tune import TuneLayer

if TYPE_CHECKING:
    from embedlens.analysis.dist import Session

Threads = Callable[[int], AbstractContextManager[None]]
"""The CPU threads for work on n tokens (a context manager)."""
CHUNK = 128
"""Rows decoded at once (float32 logits of CHUNK x V, a few copies)."""
CHECK_ROWS = 256
"""Rows of each sequence the refinement's check decodes at every layer."""


@dataclass
class _Sums:
    """Per layer: the sum of KL over positions and of cross-entropy over next tokens."""

    kl: list[float]
    ce: list[float]

    @classmethod
    def zeros(cls, n_layers: int) -> _Sums:
        return cls([0.0] * n_layers, [0.0] * n_layers)


class _Evaluation:
    """Sums over the held-out sequences, one sequence at a time."""

    def __init__(self, model: nn.Module, blocks: Blocks, own: ModelDecoder, tuned: TunedDecoder):
        self.model, self.blocks = model, blocks
        self.n_layers = len(blocks.modules)
        self.lenses = ((_Sums.zeros(self.n_layers), own), (_Sums.zeros(self.n_layers), tuned))
        self.model_ce = 0.0
        self.n_kl = self.n_ce = 0

    def add(self, ids: list[int]) -> None:
        """One sequence: every position's KL, every next token's cross-entropy, per layer."""
        n_layers = self.n_layers
        cap = capture(self.model, self.blocks, [ids], [list(range(len(ids)))], range(n_layers + 1))
        assert cap.logits is not None
        labels = torch.tensor([*ids[1:], -1], device=cap.logits.device)
        device = input_device(self.model)
        for start in range(0, len(ids), CHUNK):
            rows = slice(start, start + CHUNK)
            real = torch.log_softmax(cap.logits[rows], dim=-1)
            p = real.exp()
            label = labels[rows]
            self.model_ce += _ce(real, label)
            for layer in range(n_layers):
                h = cap.residual[layer][rows].to(device)
                for sums, decoder in self.lenses:
                    lq = torch.log_softmax(decoder.logits(h, [layer] * len(h)).float(), -1)
                    lq = lq.to(real.device)
                    sums.kl[layer] += _total((p * (real - lq)).sum(-1))
                    sums.ce[layer] += _ce(lq, label)
        self.n_kl += len(ids)
        self.n_ce += len(ids) - 1

    def reduce(self, sum_floats: Callable[[list[float]], list[float]]) -> None:
        """The sums of every process added (`sum_floats` sums values over them)."""
        (logit, _), (lens, _) = self.lenses
        parts = (logit.kl, logit.ce, lens.kl, lens.ce)
        flat = sum_floats(
            [v for part in parts for v in part] + [self.model_ce, self.n_kl, self.n_ce]
        )
        n = self.n_layers
        for i, part in enumerate(parts):
            part[:] = flat[i * n : (i + 1) * n]
        self.model_ce = flat[4 * n]
        self.n_kl, self.n_ce = round(flat[4 * n + 1]), round(flat[4 * n + 2])

    def layers(self, to_bits: float) -> list[TuneLayer]:
        """Layers 0..L: means per token, and in bits per byte."""
        (logit, _), (lens, _) = self.lenses
        kl, ce = self.n_kl, self.n_ce
        out = [
            _layer(layer, logit.kl[layer] / kl, lens.kl[layer] / kl, logit.ce[layer] / ce,
                   lens.ce[layer] / ce, to_bits)
            for layer in range(self.n_layers)
        ]  # fmt: skip
        model_ce = self.model_ce / ce
        out.append(_layer(self.n_layers, 0.0, 0.0, model_ce, model_ce, to_bits))
        return out


def layer_kl(
    model: nn.Module,
    blocks: Blocks,
    decoder: TunedDecoder,
    data: Sequences,
    threads: Threads,
    rows: int = CHECK_ROWS,
) -> list[float]:
    """The mean KL(model's output ‖ lens) of each layer 0..L-1 over `data`, through `decoder`,
    at about `rows` positions of each sequence, evenly spaced (the refinement's check of each
    translator on rows it did not train on)."""
    n_layers = len(blocks.modules)
    sums, n = [0.0] * n_layers, 0
    device = input_device(model)
    for ids in data.ids:
        read = list(range(0, len(ids), -(-len(ids) // rows)))
        with torch.inference_mode(), threads(len(ids)):
            cap = capture(model, blocks, [ids], [read], range(n_layers + 1))
            assert cap.logits is not None
            for start in range(0, len(read), CHUNK):
                part = slice(start, start + CHUNK)
                real = torch.log_softmax(cap.logits[part], dim=-1)
                p = real.exp()
                for layer in range(n_layers):
                    h = cap.residual[layer][part].to(device)
                    lq = torch.log_softmax(decoder.logits(h, [layer] * len(h)).float(), -1)
                    sums[layer] += _total((p * (real - lq.to(real.device))).sum(-1))
        n += len(read)
    return [s / n for s in sums]


def evaluate(
    model: nn.Module,
    blocks: Blocks,
    own: ModelDecoder,
    tuned: TunedDecoder,
    data: Sequences,
    on_sequence: Callable[[int, int], None] | None = None,
    *,
    threads: Threads = lambda n: nullcontext(),
    session: Session | None = None,
) -> list[TuneLayer]:
    """Every layer's figures over the held-out sequences, in float64 sums (`threads`: the CPU
    threads for work on n tokens; under torchrun, `session`: sequence s on rank s mod N, the
    sums added over processes)."""
    run = _Evaluation(model, blocks, own, tuned)
    share = range(len(data)) if session is None else session.share(len(data))
    for s, i in enumerate(share, 1):
        ids = data.ids[i]
        with torch.inference_mode(), threads(len(ids)):
            run.add(ids)
        if on_sequence is not None:
            on_sequence(s, len(data))
    if session is not None:
        run.reduce(session.sum_floats)
    return run.layers(data.tokens_per_byte() / math.log(2))


def _total(values: torch.Tensor) -> float:
    """The sum of a few values, in float64 and in order (a tensor's sum to one value would be
    split between threads, and its last bits depend on how many)."""
    return math.fsum(values.double().tolist())


def _ce(log_probs: torch.Tensor, labels: torch.Tensor) -> float:
    """The sum of -log q(next token) over rows that have a next token (label >= 0)."""
    keep = labels >= 0
    if not bool(keep.any()):
        return 0.0
    return -_total(log_probs[keep].gather(1, labels[keep][:, None]).flatten())


def _layer(layer: int, lkl: float, tkl: float, lce: float, tce: float, to_bits: float) -> TuneLayer:
    return TuneLayer(
        layer=layer,
        logit_kl=lkl,
        tuned_kl=tkl,
        logit_ce=lce,
        tuned_ce=tce,
        logit_kl_bpb=lkl * to_bits,
        tuned_kl_bpb=tkl * to_bits,
        logit_ce_bpb=lce * to_bits,
        tuned_ce_bpb=tce * to_bits,
    )
