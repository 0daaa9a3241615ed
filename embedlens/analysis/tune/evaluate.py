"""The held-out evaluation: per layer, the logit lens and the tuned lens against the model.

For each held-out position and layer: KL(model's output ‖ lens) in nats, over the model's whole
softmax, at every position (what the refinement minimises); the cross-entropy of the next token
in nats, at every position that has one in its sequence (tuned-lens's `eval_loop`: the KL at the
token read, the cross-entropy shifted by one). Bits per byte are tuned-lens's conversion: nats
per token x (tokens / UTF-8 bytes of the held-out text) / ln 2. The last layer is the model's own
output (KL 0, the model's cross-entropy), for both lenses.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from embedlens.analysis.lens.decoders import Translators, TunedDecoder
from embedlens.analysis.tune.data import Sequences
from embedlens.reports.tune import TuneLayer

if TYPE_CHECKING:
    from embedlens.analysis.dist import Session
    from embedlens.analysis.lens.jacobian import Transport
    from embedlens.analysis.tune.reading import Reader
    from embedlens.progress import Progress

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


Decode = Callable[[torch.Tensor, list[int]], torch.Tensor]
"""A lens's logits [n, V] for residual rows [n, d] read at the layers given."""


class _Evaluation:
    """Sums over sequences, one sequence at a time, through the tuned lens (with `logit`, the
    logit lens before it, and with `jacobian` the Jacobian lens after it; the cross-entropy with
    `ce`)."""

    def __init__(
        self,
        reader: Reader,
        translators: Translators,
        *,
        logit: bool,
        ce: bool,
        jacobian: Transport | None = None,
    ):
        self.reader, self.ce = reader, ce
        self.n_layers = n = reader.n_layers
        own = reader.own
        decoders: list[Decode] = [own.logits] if logit else []
        decoders.append(TunedDecoder(own, translators).logits)
        if jacobian is not None:
            decoders.append(TunedDecoder(own, jacobian).logits)
        self.lenses = [(_Sums.zeros(n), decoder) for decoder in decoders]
        self.model_ce = 0.0
        self.n_kl = self.n_ce = 0

    def add(self, ids: list[int], read: Sequence[int] | None = None) -> None:
        """One sequence at the positions `read` (all by default): each one's KL, and with `ce`
        every next token's cross-entropy, per layer."""
        n_layers, device = self.n_layers, self.reader.device
        with self.reader.read(ids, read) as cap:
            assert cap.logits is not None
            labels = torch.tensor([*ids[1:], -1], device=cap.logits.device) if self.ce else None
            rows_read = len(cap.logits)
            for start in range(0, rows_read, CHUNK):
                rows = slice(start, start + CHUNK)
                real = torch.log_softmax(cap.logits[rows], dim=-1)
                p = real.exp()
                label = None if labels is None else labels[rows]
                if label is not None:
                    self.model_ce += _ce(real, label)
                for layer in range(n_layers):
                    h = cap.residual[layer][rows].to(device)
                    for sums, decoder in self.lenses:
                        lq = torch.log_softmax(decoder(h, [layer] * len(h)).float(), -1)
                        lq = lq.to(real.device)
                        sums.kl[layer] += _total((p * (real - lq)).sum(-1))
                        if label is not None:
                            sums.ce[layer] += _ce(lq, label)
        self.n_kl += rows_read
        self.n_ce += len(ids) - 1

    def reduce(self, sum_floats: Callable[[list[float]], list[float]]) -> None:
        """The sums of every process added (`sum_floats` sums values over them)."""
        parts = [part for sums, _ in self.lenses for part in (sums.kl, sums.ce)]
        flat = sum_floats(
            [v for part in parts for v in part] + [self.model_ce, self.n_kl, self.n_ce]
        )
        n, at = self.n_layers, len(parts) * self.n_layers
        for i, part in enumerate(parts):
            part[:] = flat[i * n : (i + 1) * n]
        self.model_ce = flat[at]
        self.n_kl, self.n_ce = round(flat[at + 1]), round(flat[at + 2])

    def layers(self, to_bits: float) -> list[TuneLayer]:
        """Layers 0..L: means per token, and in bits per byte (the Jacobian lens's too, when
        evaluated)."""
        (logit, _), (lens, _), *rest = self.lenses
        kl, ce = self.n_kl, self.n_ce
        out = [
            _layer(layer, logit.kl[layer] / kl, lens.kl[layer] / kl, logit.ce[layer] / ce,
                   lens.ce[layer] / ce, to_bits)
            for layer in range(self.n_layers)
        ]  # fmt: skip
        model_ce = self.model_ce / ce
        out.append(_layer(self.n_layers, 0.0, 0.0, model_ce, model_ce, to_bits))
        if rest:
            ((j, _),) = rest
            figures = [(j.kl[i] / kl, j.ce[i] / ce) for i in range(self.n_layers)]
            figures.append((0.0, model_ce))
            out = [_with_jacobian(row, *f, to_bits) for row, f in zip(out, figures, strict=True)]
        return out


def layer_kl(
    reader: Reader,
    translators: Translators,
    data: Sequences,
    rows: int = CHECK_ROWS,
    progress: Progress | None = None,
    which: str = "",
) -> list[float]:
    """The mean KL(model's output ‖ lens) of each layer 0..L-1 over `data`, through the tuned
    lens of `translators`, at about `rows` positions of each sequence, evenly spaced (the
    refinement's check of each translator on rows it did not train on); `progress` is told
    'checking' (`which` translators) before the first sequence and after each."""
    run = _Evaluation(reader, translators, logit=False, ce=False)
    n = len(data.ids)
    for done, ids in enumerate(data.ids):
        if progress is not None:
            progress("checking", done, n, "sequences", which)
        run.add(ids, range(0, len(ids), -(-len(ids) // rows)))
    if progress is not None:
        progress("checking", n, n, "sequences", which)
    ((sums, _),) = run.lenses
    return [s / run.n_kl for s in sums.kl]


def evaluate(
    reader: Reader,
    translators: Translators,
    data: Sequences,
    share: range,
    on_sequence: Callable[[], None] | None = None,
    *,
    session: Session | None = None,
    jacobian: Transport | None = None,
) -> list[TuneLayer]:
    """Every layer's figures over the held-out sequences `share` of `data` (this process's:
    under torchrun, `session`, sequence s on rank s mod N, the sums added over processes), the
    logit lens beside the tuned lens of `translators` (and the Jacobian lens of `jacobian`), in
    float64 sums."""
    run = _Evaluation(reader, translators, logit=True, ce=True, jacobian=jacobian)
    for i in share:
        run.add(data.ids[i])
        if on_sequence is not None:
            on_sequence()
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


def _with_jacobian(row: TuneLayer, kl: float, ce: float, to_bits: float) -> TuneLayer:
    return dataclasses.replace(
        row, jacobian_kl=kl, jacobian_ce=ce, jacobian_kl_bpb=kl * to_bits,
        jacobian_ce_bpb=ce * to_bits,
    )  # fmt: skip
