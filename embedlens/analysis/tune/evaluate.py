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
from dataclasses import dataclass, field

import torch
from torch import nn

from embedlens.analysis.lens.blocks import Blocks, input_device
from embedlens.analysis.lens.capture import capture
from embedlens.analysis.lens.decoder import ModelDecoder
from embedlens.analysis.lens.tuned import TunedDecoder
from embedlens.analysis.tune.data import Sequences
from embedlens.reports.tune import TuneLayer

CHUNK = 128
"""Rows decoded at once (float32 logits of CHUNK x V, a few copies)."""


@dataclass
class _Sums:
    """Per lens: the sum of KL over positions and of cross-entropy over next tokens, per layer."""

    kl: list[float] = field(default_factory=list)
    ce: list[float] = field(default_factory=list)


def evaluate(
    model: nn.Module,
    blocks: Blocks,
    own: ModelDecoder,
    tuned: TunedDecoder,
    data: Sequences,
    on_sequence: Callable[[int, int], None] | None = None,
) -> list[TuneLayer]:
    """Every layer's figures over the held-out sequences, in float64 sums."""
    n_layers = len(blocks.modules)
    logit, lens = (
        _Sums([0.0] * n_layers, [0.0] * n_layers),
        _Sums([0.0] * n_layers, [0.0] * n_layers),
    )
    model_ce, n_kl, n_ce = 0.0, 0, 0
    device = input_device(model)
    with torch.inference_mode():
        for s, ids in enumerate(data.ids, 1):
            cap = capture(model, blocks, [ids], [list(range(len(ids)))], range(n_layers + 1))
            assert cap.logits is not None
            labels = torch.tensor([*ids[1:], -1], device=cap.logits.device)
            for start in range(0, len(ids), CHUNK):
                rows = slice(start, start + CHUNK)
                real = torch.log_softmax(cap.logits[rows], dim=-1)
                label = labels[rows]
                model_ce += _ce(real, label)
                for layer in range(n_layers):
                    h = cap.residual[layer][rows].to(device)
                    for sums, decoder in ((logit, own), (lens, tuned)):
                        lq = torch.log_softmax(decoder.logits(h, [layer] * len(h)).float(), -1)
                        lq = lq.to(real.device)
                        sums.kl[layer] += float((real.exp() * (real - lq)).sum(dtype=torch.float64))
                        sums.ce[layer] += _ce(lq, label)
            n_kl += len(ids)
            n_ce += len(ids) - 1
            if on_sequence is not None:
                on_sequence(s, len(data))
    to_bits = data.tokens_per_byte() / math.log(2)
    out = [
        _layer(layer, logit.kl[layer] / n_kl, lens.kl[layer] / n_kl, logit.ce[layer] / n_ce,
               lens.ce[layer] / n_ce, to_bits)
        for layer in range(n_layers)
    ]  # fmt: skip
    out.append(_layer(n_layers, 0.0, 0.0, model_ce / n_ce, model_ce / n_ce, to_bits))
    return out


def _ce(log_probs: torch.Tensor, labels: torch.Tensor) -> float:
    """The sum of -log q(next token) over rows that have a next token (label >= 0)."""
    keep = labels >= 0
    if not bool(keep.any()):
        return 0.0
    picked = log_probs[keep].gather(1, labels[keep][:, None])
    return -float(picked.sum(dtype=torch.float64))


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
