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

from embedlens.analysis.lens.parity_math import decode, distances, kl_lse, next_deltas, top1
from embedlens.reports.lens_parity import (
    ParityLayer,
    ParityOutput,
    ParitySequence,
    ParitySiteLayer,
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
    sites: tuple[str, ...] = ()
    """The sites inside the blocks it holds (`--site`: resid_mid, attn_out, mlp_out)."""
    site_rows: Callable[[str, int], torch.Tensor] | None = None
    """A site's rows at block `layer` (1..L), every position, [T, H]."""


@dataclass(frozen=True)
class Tails:
    """Each side's decoder (the same object when both sides decode through one tail), the
    model's number of blocks, its real tokens, and how a token id is shown."""

    a: Decoder
    b: Decoder
    num_layers: int
    real_vocab: int
    token: Callable[[int], str]


@dataclass
class SeqFigures:
    """One sequence's figures, per position: what `Tally` reduces (picklable, so that each
    process under torchrun hands its sequences' to rank 0, which reduces them in order)."""

    index: int
    name: str
    positions: list[int]
    tokens: list[int]
    rel: dict[int, np.ndarray] = field(default_factory=dict)
    cos: dict[int, np.ndarray] = field(default_factory=dict)
    kl: dict[int, np.ndarray] = field(default_factory=dict)
    residual_kl: dict[int, np.ndarray] = field(default_factory=dict)
    agree: dict[int, np.ndarray] = field(default_factory=dict)
    output: _Out | None = None
    site_rel: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)
    site_cos: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)
    checks: list[tuple[float, float]] = field(default_factory=list)
    """Per side, with its model's own logits: (max |Δ|, tolerance); NaN where not checked."""


@dataclass
class _Out:
    delta: np.ndarray
    flips: np.ndarray
    logits_rel: np.ndarray
    positions: list[int]
    next_tokens: list[int]


class Tally:
    """The figures of every sequence compared, and their reduction into the report's rows."""

    def __init__(
        self, tails: Tails, layers: list[int], out_layer: int | None, sites: tuple[str, ...] = ()
    ) -> None:
        self.tails = tails
        self.layers = layers
        self.sites = sites
        """The sites inside the blocks compared besides the residual stream."""
        self.out_layer = out_layer
        """The last block's output when both sides hold it (the output figures), else None."""
        self.done: list[SeqFigures] = []

    def add(self, index: int, a: Stack, b: Stack, positions: Sequence[int]) -> None:
        """Sequence `index`'s two runs, compared at `positions` at each layer, and at the
        output at those with a next token."""
        import torch

        pos = list(positions)
        f = SeqFigures(index, a.name, pos, [a.ids[p] for p in pos])
        with torch.inference_mode():
            for layer in self.layers:
                ra, rb = a.rows(layer)[pos], b.rows(layer)[pos]
                f.rel[layer], f.cos[layer] = distances(ra, rb)
                za, zb, lse = self._lenses(f, layer, ra, rb)
                if layer == self.out_layer:
                    f.output = _output(za, zb, lse, a.ids, pos, self.tails.real_vocab)
            if f.output is None and self.out_layer is not None:
                n = self.out_layer
                za, zb = decode(self.tails.a, a.rows(n)[pos]), decode(self.tails.b, b.rows(n)[pos])
                lse = kl_lse(za, zb)[1:]
                f.output = _output(za, zb, lse, a.ids, pos, self.tails.real_vocab)
            self._sites(f, a, b, pos)
            f.checks = [
                _check(s, d, self.tails.num_layers)
                for s, d in ((a, self.tails.a), (b, self.tails.b))
            ]
        self.done.append(f)

    def _sites(self, f: SeqFigures, a: Stack, b: Stack, pos: list[int]) -> None:
        """Each site asked for, at each block shown, compared as the residual stream is."""

        for site in self.sites:
            assert a.site_rows is not None and b.site_rows is not None
            for layer in (x for x in self.layers if x >= 1):
                ra, rb = a.site_rows(site, layer)[pos], b.site_rows(site, layer)[pos]
                f.site_rel[site, layer], f.site_cos[site, layer] = distances(ra, rb)

    def site_rows(self) -> list[ParitySiteLayer] | None:
        """Each site's figures at each block shown (None: no site asked for)."""
        import numpy as np

        if not self.sites:
            return None
        done, out = self.ordered(), []
        for layer in (x for x in self.layers if x >= 1):
            for site in self.sites:
                rel = np.concatenate([f.site_rel[site, layer] for f in done])
                cos = np.concatenate([f.site_cos[site, layer] for f in done])
                out.append(ParitySiteLayer(layer, site, *_spread(rel, cos)))
        return out

    def _lenses(self, f: SeqFigures, layer: int, ra: torch.Tensor, rb: torch.Tensor) -> Any:
        """A layer's two lenses: their KL, the residual KL and whether their top-1 agree; the
        logits and each row's log-sum-exp (for the output's δ)."""
        t = self.tails
        za, zb = decode(t.a, ra), decode(t.b, rb)
        f.kl[layer], la, lb = kl_lse(za, zb)
        f.residual_kl[layer] = f.kl[layer] if t.a is t.b else kl_lse(za, decode(t.a, rb))[0]
        f.agree[layer] = top1(za, t.real_vocab) == top1(zb, t.real_vocab)
        return za, zb, (la, lb)

    def ordered(self) -> list[SeqFigures]:
        return sorted(self.done, key=lambda f: f.index)

    def layer_rows(self) -> list[ParityLayer]:
        """Each layer's figures over every position compared, in the sequences' order."""
        import numpy as np

        done, out = self.ordered(), []
        where = [(f.name, f.positions, f.tokens) for f in done]
        for layer in self.layers:

            def cat(name: str, layer: int = layer) -> np.ndarray:
                return np.concatenate([getattr(f, name)[layer] for f in done])

            rel, cos = cat("rel"), cat("cos")
            worst = _worst(where, rel, 1, self.tails.token)[0]
            out.append(
                ParityLayer(
                    layer,
                    *_spread(rel, cos),
                    float(np.mean(cat("kl"))),
                    float(np.mean(cat("residual_kl"))),
                    float(np.mean(cat("agree"))),
                    worst,
                )
            )
        return out

    def output(self, cap: float) -> ParityOutput | None:
        """The output figures (None: no last layer on both sides, or no scored token)."""
        import numpy as np

        outs = [(f, f.output) for f in self.ordered() if f.output is not None]
        if not outs or not sum(len(o.delta) for _, o in outs):
            return None
        delta = np.concatenate([o.delta for _, o in outs])
        size = np.abs(delta)
        seqs = [
            ParitySequence(
                f.name, len(o.delta), float(np.sum(o.delta)), _exp(float(np.sum(o.delta)))
            )
            for f, o in outs
        ]
        where = [(f.name, o.positions, o.next_tokens) for f, o in outs]
        return ParityOutput(
            n_tokens=int(delta.size),
            delta_mean=float(np.mean(delta)),
            delta_rms=float(np.sqrt(np.mean(delta * delta))),
            delta_p99=float(np.percentile(size, 99)),
            delta_max=float(np.max(size)),
            top1_flip=float(np.mean(np.concatenate([o.flips for _, o in outs]))),
            logits_rms_rel_mean=float(np.mean(np.concatenate([o.logits_rel for _, o in outs]))),
            cap=cap,
            n_over_cap=sum(1 for s in seqs if s.ratio > cap),
            n_under_cap=sum(1 for s in seqs if s.ratio < 1 / cap),
            sequences=seqs,
            worst=_worst(where, size, N_WORST, self.tails.token),
        )

    def check(self, side: int) -> tuple[float, float, int]:
        """A side's check over every sequence: the largest |Δ|, the largest tolerance, and how
        many sequences were checked."""
        made = [f.checks[side] for f in self.done if not math.isnan(f.checks[side][0])]
        if not made:
            return math.nan, math.nan, 0
        return max(d for d, _ in made), max(t for _, t in made), len(made)


def _spread(rel: np.ndarray, cos: np.ndarray) -> tuple[float, float, float, float, float]:
    """The RMS relative differences' mean, median and max, and the cosines' mean and min."""
    import numpy as np

    return (
        float(np.mean(rel)),
        float(np.median(rel)),
        float(np.max(rel)),
        float(np.mean(cos)),
        float(np.min(cos)),
    )


def _output(
    za: torch.Tensor,
    zb: torch.Tensor,
    lse: tuple[torch.Tensor, torch.Tensor],
    ids: list[int],
    pos: list[int],
    vocab: int,
) -> _Out:
    """The output figures of one sequence from its two runs' output logits at `pos` (and each
    row's log-sum-exp)."""
    scored = [i for i, p in enumerate(pos) if p + 1 < len(ids)]
    nxt = [ids[pos[i] + 1] for i in scored]
    za, zb = za[scored], zb[scored]
    delta = next_deltas(za, zb, (lse[0][scored], lse[1][scored]), nxt)
    flips = top1(za, vocab) != top1(zb, vocab)
    return _Out(delta, flips, distances(za, zb)[0], [pos[i] for i in scored], nxt)


def _check(stack: Stack, decoder: Decoder, n: int) -> tuple[float, float]:
    """A side's decoding of its last layer at the last position against its model's own
    logits there: (max |Δ|, tolerance); NaN when its run kept none or holds no last layer."""
    import torch

    from embedlens.analysis.lens.engine import tolerance

    if stack.logits is None or n not in stack.layers:
        return math.nan, math.nan
    row = stack.rows(n)[-1:]
    mine = decode(decoder, row)[0]
    own = stack.logits.float()
    dtype = max((row.dtype, _dtype(decoder)), key=lambda d: torch.finfo(d).eps)
    return float((mine - own).abs().max()), tolerance(dtype, own)


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
