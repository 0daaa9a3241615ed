"""Per-layer statistics of the lens: what each is, and the one accumulator they are summed in.

`Sums` is the accumulator every reduction over many rows adds into (the `--prompts` summary
(`many.LensStats`), the sites' rows of `--prompts --site`, a pair's means, and the row
statistics of `--text`'s windows); it keeps a total and a count per statistic, and ranks as a
histogram, so memory does not grow with the rows added. `STATS` says once how each per-layer
statistic is read out of it, by the name its report field has.

`ROW_STATS` defines, each in one place, a statistic every decoded row gives from its logits and
its tokens (`Scored`: its target, its observed next token): every ranking of decoded rows
(`ranking`) computes them, a row's report shows them by name, and every reduction adds them to
its sums (`add_row`) under their summary's name (B's with `against_` before it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from embedlens.reports.lens import LensLayerStats

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Stat:
    """How a per-layer statistic is read out of its sums."""

    median: bool = False
    """The median of the ranks added (`Sums.rank`), not the mean of the values added."""
    optional: bool = False
    """None where nothing was added (a target's figures without one); else 0 then."""


@dataclass(frozen=True)
class Scored:
    """A chunk of decoded rows, as the per-row statistics read them."""

    x: torch.Tensor
    """The rows' logits, float32 [n, V] (over the model's whole output)."""
    real_vocab: int
    """Ids at or past this are padding rows: never ranked."""
    targets: Sequence[int | None]
    """Each row's --target (None: none)."""
    nexts: Sequence[int | None]
    """Each row's observed next token (None: the row is the prompt's last)."""


@dataclass(frozen=True)
class RowStat:
    """A statistic each decoded row gives, and how the reductions keep it."""

    values: Callable[[Scored], list[Any]]
    """Its value at each row of a chunk, as its report field types it (None where the row has
    none)."""
    summary: str
    """The name of its reduction's report field."""
    median: bool = False
    """Reduced to the median of its values (integers), else to their mean."""


def _next_rank(rows: Scored) -> list[int | None]:
    """The rank of each row's target, else of its observed next token, among the real tokens
    by logit (`target_ranks`: 1 = top, equal logits the lower id first)."""
    tokens = [t if t is not None else n for t, n in zip(rows.targets, rows.nexts, strict=True)]
    at = [r for r, t in enumerate(tokens) if t is not None]
    out: list[int | None] = [None] * len(tokens)
    if at:
        real = rows.x[:, : rows.real_vocab]
        ranked = target_ranks(rows.x, real, at, [int(tokens[r] or 0) for r in at])
        for r, value in zip(at, ranked, strict=True):
            out[r] = value
    return out


ROW_STATS: dict[str, RowStat] = {
    "next_rank": RowStat(_next_rank, "next_rank_median", median=True),
}
"""The per-row statistics, by the name a row's report field has."""


RowValues = dict[str, Any]
"""A row's `ROW_STATS` by name, each as its report field types it (None where it has none)."""


def row_stats(
    x: torch.Tensor,
    real_vocab: int,
    targets: Sequence[int | None],
    nexts: Sequence[int | None] | None = None,
) -> list[RowValues]:
    """Every `ROW_STATS` statistic at each row of a chunk of logits `x` (`targets`, `nexts`:
    each row's --target and observed next token; None: none, or not known)."""
    if not ROW_STATS:
        return [{} for _ in range(x.shape[0])]
    after = [None] * len(targets) if nexts is None else nexts
    scored = Scored(x, real_vocab, targets, after)
    values = {name: stat.values(scored) for name, stat in ROW_STATS.items()}
    return [{name: v[r] for name, v in values.items()} for r in range(int(x.shape[0]))]


def target_ranks(
    x: torch.Tensor, real: torch.Tensor, rows: list[int], tids: list[int]
) -> list[int]:
    """The rank of token tids[j] in row rows[j]: 1 + the real tokens of a higher logit, or of the
    same logit and a lower id (`ranking`'s order: equal logits, the lower id first)."""
    import torch

    tid = torch.tensor(tids, device=x.device)
    every = rows == list(range(x.shape[0]))  # a chunk's every row: no copy of it
    at = torch.tensor(rows, device=x.device)
    value = (x if every else x[at]).gather(1, tid[:, None])
    sub = real if every else real[at]
    # counted as float32 0/1 (exact below 2^24 tokens): torch sums a bool array along a row
    # several times slower than it compares, and a float array faster
    hits = torch.empty(sub.shape, dtype=torch.float32, device=x.device)
    ranks = torch.gt(sub, value, out=hits).sum(-1).long() + 1
    # equal logits of a lower id count too: only rows where another token's logit equals the
    # token's own (or whose token is past the real ones) have any, and are counted one by one
    width = int(sub.shape[1])
    tied = (torch.eq(sub, value, out=hits).sum(-1) > 1) | (tid >= width)
    for j in tied.nonzero().flatten().tolist():
        below = sub[j, : min(int(tid[j]), width)]
        ranks[j] += int((below == value[j]).sum())
    return ranks.tolist()


def next_ids(ids: Sequence[int], positions: Iterable[int]) -> list[int | None]:
    """The observed next token after each position of a prompt (None after its last)."""
    return [int(ids[p + 1]) if 0 <= p + 1 < len(ids) else None for p in positions]


def add_row(acc: Sums, stats: RowValues, prefix: str = "") -> None:
    """One row's `ROW_STATS` values added to `acc`, each under its summary's name (`prefix`
    before it: the other side of a comparison)."""
    for name, value in stats.items():
        if value is None:
            continue
        stat = ROW_STATS[name]
        if stat.median:
            acc.rank(prefix + stat.summary, int(value))
        else:
            acc.add(prefix + stat.summary, float(value))


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
    **{
        prefix + row.summary: Stat(median=row.median, optional=True)
        for row in ROW_STATS.values()
        for prefix in ("", "against_")
    },
}
"""Every per-layer statistic the reductions keep, by the name its report field has: a mean of
the values added (each counted), or a median of ranks; a row statistic's for each side of a
comparison."""


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


LAYER_STATS = tuple(f.name for f in fields(LensLayerStats) if f.name != "layer")
"""The statistics of a `--prompts` summary's rows."""


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
