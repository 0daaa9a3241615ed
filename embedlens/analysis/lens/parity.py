"""Parity: two runs of the same weights (two implementations' saved states, one model in two
precisions) compared layer by layer over every position, and at the output token by token.

A run of one sequence is a `Stack` (every layer's residual stream at every position, however it
was made: `parity_run` makes them); `Tally` takes the two runs of each sequence in turn, each
decoded through its own tail, and keeps per position what the report reduces. Every figure is
computed in float64 on one thread from the two runs' rows (docs/parity.md), so the same rows give
the same bits on any machine load.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from embedlens.reports.lens_parity import (
    ParityLayer,
    ParityOutput,
    ParitySequence,
    Worst,
)

if TYPE_CHECKING:
    import numpy as np
    import torch

    from embedlens.analysis.lens.blocks import Decoder

CAP = 3.0
"""The importance-ratio cap by default: TRL's `vllm_importance_sampling_cap`."""
THRESHOLD = 1e-3
"""The RMS relative difference (mean over positions) above which a layer counts as divergent."""
CHUNK = 64
"""Rows decoded at a time (each [CHUNK, V] float32, and float64 while its KL is taken)."""
N_WORST = 5


@dataclass(frozen=True)
class Stack:
    """One run of one sequence: `rows(layer)` gives that layer's residual at every position,
    [T, H] in the run's dtype; `logits`: the model's own at the last position (None: not kept)."""

    name: str
    ids: list[int]
    layers: list[int]
    rows: Callable[[int], torch.Tensor]
    logits: torch.Tensor | None


@dataclass(frozen=True)
class Tails:
    """Each side's decoder (the same object when both sides decode through one tail), the
    model's number of blocks, its real tokens, and the layers whose lens is decoded."""

    a: Decoder
    b: Decoder
    num_layers: int
    real_vocab: int
    decoded: list[int]
    token: Callable[[int], str]


@dataclass
class _Layer:
    rel: list[np.ndarray] = field(default_factory=list)
    cos: list[np.ndarray] = field(default_factory=list)
    kl: list[np.ndarray] = field(default_factory=list)
    residual_kl: list[np.ndarray] = field(default_factory=list)
    agree: list[np.ndarray] = field(default_factory=list)
    where: list[tuple[str, list[int], list[int]]] = field(default_factory=list)


@dataclass
class _Check:
    """The largest distance between a side's decoding of its last layer at the last position
    and the model's own logits there, over every sequence that kept them."""

    diff: float = 0.0
    tolerance: float = 0.0
    made: int = 0


class Tally:
    """What the report needs of every sequence, kept as the two runs are compared."""

    def __init__(self, tails: Tails, layers: list[int]) -> None:
        self.tails = tails
        self.layers = layers
        self.per = {layer: _Layer() for layer in layers}
        self.deltas: list[np.ndarray] = []
        self.flips: list[np.ndarray] = []
        self.logits_rel: list[np.ndarray] = []
        self.sequences: list[ParitySequence] = []
        self.out_where: list[tuple[str, list[int], list[int]]] = []
        self.checks = (_Check(), _Check())
        self.n_tokens = 0
        self.n_sequences = 0

    def add(self, a: Stack, b: Stack, positions: Sequence[int]) -> None:
        """One sequence's two runs, compared at `positions` (each layer), the output at those
        with a next token."""
        import torch

        from embedlens.analysis.lens.blocks import one_thread

        pos = list(positions)
        self.n_tokens += len(pos)
        self.n_sequences += 1
        t = self.tails
        with torch.inference_mode():
            for layer in self.layers:
                ra, rb = a.rows(layer)[pos], b.rows(layer)[pos]
                kept = self.per[layer]
                with one_thread():
                    rel, cos = distances(ra, rb)
                kept.rel.append(rel)
                kept.cos.append(cos)
                kept.where.append((a.name, pos, [a.ids[p] for p in pos]))
                if layer in t.decoded or layer == t.num_layers:
                    self._decoded(layer, ra, rb, a, pos)
            for side, stack, decoder in ((0, a, t.a), (1, b, t.b)):
                self._check(side, stack, decoder)

    def _decoded(
        self, layer: int, ra: torch.Tensor, rb: torch.Tensor, a: Stack, pos: list[int]
    ) -> None:
        """A layer's two lenses: KL, residual KL and top-1 (a layer asked for); the output
        figures at the last layer."""
        import numpy as np

        t = self.tails
        za, zb = decode(t.a, ra), decode(t.b, rb)
        kept = self.per[layer]
        if layer in t.decoded:
            kl = kl_each(za, zb)
            kept.kl.append(kl)
            same = t.a is t.b
            kept.residual_kl.append(kl if same else kl_each(za, decode(t.a, rb)))
            kept.agree.append(top1(za, t.real_vocab) == top1(zb, t.real_vocab))
        if layer != t.num_layers:
            return
        scored = [i for i, p in enumerate(pos) if p + 1 < len(a.ids)]
        nxt = [a.ids[pos[i] + 1] for i in scored]
        delta = next_deltas(za[scored], zb[scored], nxt)
        self.deltas.append(delta)
        va, vb = top1(za[scored], t.real_vocab), top1(zb[scored], t.real_vocab)
        self.flips.append(va != vb)
        from embedlens.analysis.lens.blocks import one_thread

        with one_thread():
            self.logits_rel.append(distances(za[scored], zb[scored])[0])
        log_ratio = float(np.sum(delta))
        self.sequences.append(ParitySequence(a.name, len(scored), log_ratio, _exp(log_ratio)))
        self.out_where.append((a.name, [pos[i] for i in scored], nxt))

    def _check(self, side: int, stack: Stack, decoder: Decoder) -> None:
        """The side's decoding of its last layer at the last position against the model's own
        logits there, when its run kept them."""
        import torch

        from embedlens.analysis.lens.engine import tolerance

        n = self.tails.num_layers
        if stack.logits is None or n not in stack.layers:
            return
        row = stack.rows(n)[-1:]
        mine = decode(decoder, row)[0]
        own = stack.logits.float()
        dtype = max((row.dtype, _dtype(decoder)), key=lambda d: torch.finfo(d).eps)
        c = self.checks[side]
        c.diff = max(c.diff, float((mine - own).abs().max()))
        c.tolerance = max(c.tolerance, tolerance(dtype, own))
        c.made += 1

    def layer_rows(self) -> list[ParityLayer]:
        """Each layer's figures over every position compared."""
        import numpy as np

        out = []
        for layer in self.layers:
            kept = self.per[layer]
            rel, cos = np.concatenate(kept.rel), np.concatenate(kept.cos)
            decoded = bool(kept.kl)
            kl = float(np.mean(np.concatenate(kept.kl))) if decoded else None
            res = float(np.mean(np.concatenate(kept.residual_kl))) if decoded else None
            agree = float(np.mean(np.concatenate(kept.agree))) if decoded else None
            worst = _worst(kept.where, rel, 1, self.tails.token)[0]
            out.append(
                ParityLayer(
                    layer,
                    float(np.mean(rel)),
                    float(np.median(rel)),
                    float(np.max(rel)),
                    float(np.mean(cos)),
                    float(np.min(cos)),
                    kl,
                    res,
                    agree,
                    worst,
                )
            )
        return out

    def output(self, cap: float) -> ParityOutput | None:
        """The output figures (None: no sequence gave the last layer, or no scored token)."""
        import numpy as np

        if not self.deltas or not sum(len(d) for d in self.deltas):
            return None
        delta = np.concatenate(self.deltas)
        size = np.abs(delta)
        over = sum(1 for s in self.sequences if s.ratio > cap)
        under = sum(1 for s in self.sequences if s.ratio < 1 / cap)
        worst = _worst(self.out_where, size, N_WORST, self.tails.token)
        return ParityOutput(
            n_tokens=int(delta.size),
            delta_mean=float(np.mean(delta)),
            delta_rms=float(np.sqrt(np.mean(delta * delta))),
            delta_p99=float(np.percentile(size, 99)),
            delta_max=float(np.max(size)),
            top1_flip=float(np.mean(np.concatenate(self.flips))),
            logits_rms_rel_mean=float(np.mean(np.concatenate(self.logits_rel))),
            cap=cap,
            n_over_cap=over,
            n_under_cap=under,
            sequences=self.sequences,
            worst=worst,
        )


def distances(a: torch.Tensor, b: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per row, in float64: ‖a − b‖ / ‖b‖ (0 where both are 0, inf where only b is) and
    cos(a, b) = (‖a‖² + ‖b‖² − ‖a − b‖²) / (2 ‖a‖ ‖b‖), which is exactly 1 for equal rows."""
    import numpy as np

    x, y = a.double(), b.double()
    sa, sb = (x * x).sum(-1).numpy(), (y * y).sum(-1).numpy()
    sd = ((x - y) ** 2).sum(-1).numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(sd == 0, 0.0, np.sqrt(sd) / np.sqrt(sb))
        cos = np.where(sd == 0, 1.0, (sa + sb - sd) / (2 * np.sqrt(sa * sb)))
    return rel, np.nan_to_num(cos, nan=0.0)


def decode(decoder: Decoder, rows: torch.Tensor) -> torch.Tensor:
    """Float32 logits [P, V] of residual rows [P, H], CHUNK rows at a time."""
    import torch

    parts = [decoder.logits(rows[i : i + CHUNK], ()).float() for i in range(0, len(rows), CHUNK)]
    return torch.cat(parts) if parts else rows.new_zeros((0, 0), dtype=torch.float32)


def kl_each(p: torch.Tensor, q: torch.Tensor) -> np.ndarray:
    """KL(softmax p ‖ softmax q) of each pair of rows, float64 (`pairing.kl_rows`)."""
    import numpy as np

    from embedlens.analysis.lens.pairing import kl_rows

    out = [kl_rows(p[i : i + CHUNK], q[i : i + CHUNK]) for i in range(0, len(p), CHUNK)]
    return np.array([x for part in out for x in part], dtype=np.float64)


def top1(logits: torch.Tensor, vocab: int) -> np.ndarray:
    """Each row's argmax among the real tokens (the lower id of equal maxima)."""
    return logits[:, :vocab].argmax(-1).numpy()


def next_deltas(za: torch.Tensor, zb: torch.Tensor, nxt: list[int]) -> np.ndarray:
    """log π_A(t) − log π_B(t) of each row's next token t, from the logits in float64."""
    import torch

    from embedlens.analysis.lens.blocks import one_thread

    if not nxt:
        import numpy as np

        return np.zeros(0)
    index = torch.tensor(nxt).unsqueeze(-1)
    with one_thread():
        la = torch.log_softmax(za.double(), -1).gather(-1, index)[:, 0]
        lb = torch.log_softmax(zb.double(), -1).gather(-1, index)[:, 0]
    return (la - lb).numpy()


def _worst(
    where: list[tuple[str, list[int], list[int]]],
    values: np.ndarray,
    n: int,
    token: Callable[[int], str],
) -> list[Worst]:
    """The `n` largest values (the first of equal ones), with their sequence, position and
    token (`where`: each sequence's name, positions and tokens, in the values' order)."""
    import numpy as np

    flat = [(name, p, t) for name, pos, toks in where for p, t in zip(pos, toks, strict=True)]
    order = np.argsort(-values, kind="stable")[:n]
    return [Worst(flat[i][0], flat[i][1], token(flat[i][2]), float(values[i])) for i in order]


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _dtype(decoder: Any) -> torch.dtype:
    """The dtype a decoder's tail computes in."""
    return next(decoder.model.parameters()).dtype  # type: ignore[no-any-return]


def first_above(rows: list[ParityLayer], threshold: float) -> int | None:
    """The first layer whose mean RMS relative difference exceeds `threshold`."""
    return next((r.layer for r in rows if r.rms_rel_mean > threshold), None)
