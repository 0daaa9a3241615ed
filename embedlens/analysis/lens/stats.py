"""Per-layer statistics of the lens over many prompts and positions.

For each (prompt, position, layer) read: KL(model's output ‖ lens at the layer) in nats, the
entropy of the lens's distribution (both over the model's whole output, as its softmax runs),
whether the lens's top-1 is the model's top-1 (by logit, among real tokens), and, with a target,
its probability, log-probability and rank. Sums and a histogram of ranks are kept per layer, so
memory does not grow with the number of prompts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from embedlens.analysis.lens.batch import KL
from embedlens.analysis.lens.engine import LensResult
from embedlens.reports.lens import LensLayerStats


@dataclass
class _Sums:
    n: int = 0
    kl: float = 0.0
    entropy: float = 0.0
    agree: int = 0
    n_target: int = 0
    target_prob: float = 0.0
    target_logprob: float = 0.0
    ranks: Counter[int] = field(default_factory=Counter)


class LensStats:
    """Sums per layer, added to one prompt at a time."""

    def __init__(self) -> None:
        self._layers: dict[int, _Sums] = {}
        self.n_prompts = 0
        self.n_positions = 0
        self.n_targets = 0

    def add(self, result: LensResult, kl: KL, model_top1: dict[int, int]) -> None:
        """One prompt: its decoded rows, (KL, entropy) for each (layer, position), and the
        model's own top-1 at each position."""
        self.n_prompts += 1
        self.n_positions += len(result.positions)
        has_target = False
        for layer in result.layers:
            acc = self._layers.setdefault(layer, _Sums())
            for pos in result.positions:
                top = result.rows[(layer, pos)]
                k, h = kl[(layer, pos)]
                acc.n += 1
                acc.kl += k
                acc.entropy += h
                acc.agree += int(top.ids[0] == model_top1[pos])
                if top.target_rank is not None:
                    has_target = True
                    acc.n_target += 1
                    acc.target_prob += float(top.target_prob or 0.0)
                    acc.target_logprob += float(top.target_logprob or 0.0)
                    acc.ranks[top.target_rank] += 1
        self.n_targets += int(has_target)

    @classmethod
    def merged(cls, parts: list[LensStats]) -> LensStats:
        """The statistics of every part together (its sums added, in the order given): the
        statistics of processes that each ran a share of the prompts."""
        out = cls()
        for part in parts:
            out.n_prompts += part.n_prompts
            out.n_positions += part.n_positions
            out.n_targets += part.n_targets
            for layer, acc in part._layers.items():
                mine = out._layers.setdefault(layer, _Sums())
                mine.n += acc.n
                mine.kl += acc.kl
                mine.entropy += acc.entropy
                mine.agree += acc.agree
                mine.n_target += acc.n_target
                mine.target_prob += acc.target_prob
                mine.target_logprob += acc.target_logprob
                mine.ranks.update(acc.ranks)
        return out

    def summary(self) -> list[LensLayerStats]:
        """The means per layer, in layer order."""
        return [_means(layer, acc) for layer, acc in sorted(self._layers.items())]


def _means(layer: int, acc: _Sums) -> LensLayerStats:
    n, t = max(acc.n, 1), acc.n_target
    return LensLayerStats(
        layer=layer,
        kl=acc.kl / n,
        entropy=acc.entropy / n,
        top1_agreement=acc.agree / n,
        target_prob=acc.target_prob / t if t else None,
        target_logprob=acc.target_logprob / t if t else None,
        target_rank_median=median_of_counts(acc.ranks) if t else None,
    )


def median_of_counts(counts: Counter[int]) -> float:
    """The median of values given as value -> count (the mean of the two middle ones when even)."""
    total = sum(counts.values())
    middle = [(total - 1) // 2, total // 2]
    out: list[int] = []
    seen = 0
    for value in sorted(counts):
        seen += counts[value]
        while middle and middle[0] < seen:
            out.append(value)
            middle.pop(0)
    return (out[0] + out[1]) / 2
