"""Per-layer statistics of the lens over many prompts and positions.

For each (prompt, position, layer) read: KL(model's output ‖ lens at the layer) in nats, the
entropy of the lens's distribution (both over the model's whole output, as its softmax runs),
whether the lens's top-1 is the model's top-1 (by logit, among real tokens), and, with a target,
its probability, log-probability and rank. Sums and a histogram of ranks are kept per layer, so
memory does not grow with the number of prompts.

`Sums` is the one accumulator every reduction over many prompts adds into (this summary, the
sites' rows of `--prompts --site`, a pair's means), and `STATS` says once how each per-layer
statistic is read out of it, by the name its report field has.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from embedlens.analysis.lens.batch import KL
from embedlens.analysis.lens.engine import LensResult
from embedlens.reports.lens import LensLayerStats


@dataclass(frozen=True)
class Stat:
    """How a per-layer statistic is read out of its sums."""

    median: bool = False
    """The median of the ranks added (`Sums.rank`), not the mean of the values added."""
    optional: bool = False
    """None where nothing was added (a target's figures without one); else 0 then."""


STATS: dict[str, Stat] = {
    "kl": Stat(),
    "entropy": Stat(),
    "top1_agreement": Stat(),
    "residual_kl": Stat(),
    "target_prob": Stat(optional=True),
    "target_logprob": Stat(optional=True),
    "target_rank_median": Stat(median=True, optional=True),
    "target_logprob_delta": Stat(optional=True),
    "change_kl": Stat(optional=True),
}
"""Every per-layer statistic the reductions keep, by the name its report field has: a mean of
the values added (each counted), or a median of ranks."""


@dataclass
class Sums:
    """The one accumulator of per-layer statistics (of one layer, or one site at a layer): each
    statistic of `STATS` a total and the count of rows it holds, and ranks as a histogram, so
    memory does not grow with the rows added."""

    totals: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    ranks: dict[str, Counter[int]] = field(default_factory=dict)

    def add(self, name: str, value: float, count: int = 1) -> None:
        """`value`, the sum of `name` over `count` rows, added."""
        self.totals[name] = self.totals.get(name, 0.0) + value
        self.counts[name] = self.counts.get(name, 0) + count

    def rank(self, name: str, rank: int, count: int = 1) -> None:
        """`count` rows of rank `rank` added to the histogram of `name`."""
        self.ranks.setdefault(name, Counter())[rank] += count

    def update(self, other: Sums) -> None:
        """`other`'s sums added into these."""
        for name, total in other.totals.items():
            self.add(name, total, other.counts[name])
        for name, ranks in other.ranks.items():
            self.ranks.setdefault(name, Counter()).update(ranks)

    def value(self, name: str) -> float | None:
        """The statistic `name` as `STATS` reads it out of the sums."""
        stat = STATS[name]
        if stat.median:
            counts = self.ranks.get(name)
            return median_of_counts(counts) if counts else None
        count = self.counts.get(name, 0)
        if stat.optional and not count:
            return None
        return self.totals.get(name, 0.0) / max(count, 1)

    def values(self, names: Iterable[str]) -> dict[str, Any]:
        """The statistics `names`, each as `value` reads it."""
        return {name: self.value(name) for name in names}


class LensStats:
    """Sums per layer, added to one prompt at a time."""

    def __init__(self) -> None:
        self._layers: dict[int, Sums] = {}
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
            acc = self._layers.setdefault(layer, Sums())
            for pos in result.positions:
                top = result.rows[(layer, pos)]
                k, h = kl[(layer, pos)]
                acc.add("kl", k)
                acc.add("entropy", h)
                acc.add("top1_agreement", int(top.ids[0] == model_top1[pos]))
                if top.target_rank is not None:
                    has_target = True
                    acc.add("target_prob", float(top.target_prob or 0.0))
                    acc.add("target_logprob", float(top.target_logprob or 0.0))
                    acc.rank("target_rank_median", top.target_rank)
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
                out._layers.setdefault(layer, Sums()).update(acc)
        return out

    def summary(self) -> list[LensLayerStats]:
        """The means per layer, in layer order."""
        return [_means(layer, acc) for layer, acc in sorted(self._layers.items())]


LAYER_STATS = tuple(f.name for f in fields(LensLayerStats) if f.name != "layer")
"""The statistics of a `--prompts` summary's rows."""


def _means(layer: int, acc: Sums) -> LensLayerStats:
    return LensLayerStats(layer=layer, **acc.values(LAYER_STATS))


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
