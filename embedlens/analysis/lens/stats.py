"""Decoded rows ranked, and the per-layer statistics of the lens: what each is, and the one
accumulator they are summed in.

One ranking of decoded rows for every run: the k real tokens of highest logit, equal logits in
id order, and a target's rank (1 + the real tokens above it: a higher logit, or the same and a
lower id). Two sources of probabilities: `exact_tops` for one prompt (the softmax in float32 as
the model computes it, log-probabilities in float64: never -inf) and `tops_from_log_softmax`
for a batch (from the rows' float32 log_softmax, which the batch computes anyway for its KL
statistics, against the model's own output: `Reference`).

`ROW_STATS` defines, each in one place, a statistic every decoded row gives from its logits and
its tokens (`Scored`: its target, its observed next token): every ranking of decoded rows
computes them, a row's report shows them by name, and every reduction adds them to its sums
(`add_row`) under their summary's name (B's with `against_` before it).

`Sums` is the accumulator every reduction over many rows adds into (the `--prompts` summary
(`many.LensStats`), the sites' rows of `--prompts --site`, a pair's means, and the row
statistics of `--text`'s windows); it keeps a total and a count per statistic, and ranks as a
histogram, so memory does not grow with the rows added. `STATS` says once how each per-layer
statistic is read out of it, by the name its report field has. torch is imported where a
function runs: a file of prompts is checked before it is.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
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
    same logit and a lower id (the ranking's order: equal logits, the lower id first)."""
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


LSE_ROWS = 64
"""Rows whose log-sum-exp `exact_top1` takes at once (in float64)."""


@dataclass(frozen=True)
class Top:
    """The top-k predictions of one row, best first by logit (ties: the lower id first), with
    their probabilities under the full softmax (float32, as the model computes them: they may
    underflow to 0) and their natural-log probabilities."""

    ids: list[int]
    probs: list[float]
    logprobs: list[float] = field(default_factory=list)
    target_prob: float | None = None
    target_rank: int | None = None
    """1 + the real tokens ranked above the target: a higher logit, or the same and a lower id."""
    target_logprob: float | None = None
    stats: RowValues = field(default_factory=dict)
    """The row's `ROW_STATS`, by name."""


def best_ids(row: torch.Tensor, kth: torch.Tensor, k: int) -> torch.Tensor:
    """The k ids of highest logit in one row, best first, equal logits in id order; `kth` is the
    k-th highest logit."""
    candidates = (row >= kth).nonzero().flatten()  # in id order: a stable sort keeps it
    order = row[candidates].sort(descending=True, stable=True).indices[:k]
    return candidates[order]


def best(real: torch.Tensor, k: int) -> torch.Tensor:
    """The k ids of highest logit of each row of `real` ([n, k]), best first, equal logits in id
    order."""
    vocab = int(real.shape[-1])
    kk = min(k, vocab)
    # one more than asked: equal logits across the k-th place show as the next one being equal
    values, idx = real.topk(min(kk + 1, vocab), dim=-1)
    ties = (values[:, kk] == values[:, kk - 1]).tolist() if kk < vocab else [False] * len(real)
    values, idx = values[:, :kk], idx[:, :kk]
    by_id = idx.sort(dim=-1).values
    order = real.gather(1, by_id).sort(dim=-1, descending=True, stable=True).indices
    out = by_id.gather(1, order)
    for r in (r for r, tied in enumerate(ties) if tied):  # equal logits across the k-th place
        out[r] = best_ids(real[r], values[r, -1], kk)
    return out


def exact_tops(
    logits: torch.Tensor,
    k: int,
    real_vocab: int,
    target: int | None,
    nexts: Sequence[int | None] | None = None,
) -> list[Top]:
    """Predictions only among the tokenizer's ids, ranked by logit; probabilities from the softmax
    over the model's whole output (padding rows too), which can underflow where logits cannot;
    log-probabilities in float64, each row's log-sum-exp on one thread; each row's `ROW_STATS`
    (`nexts`: the token after each row's position)."""
    from embedlens.analysis.lens.blocks import one_thread

    x = logits.float()
    probs = x.softmax(dim=-1)
    real = x[:, :real_vocab]
    ids = best(real, k)
    with one_thread():  # a reduction to one value is split between threads: same bytes on any
        lses = [x[r].double().logsumexp(dim=-1) for r in range(x.shape[0])]
    ranks = [] if target is None else target_ranks(x, real, list(range(len(x))), [target] * len(x))
    stats = row_stats(x, real_vocab, [target] * len(x), nexts)
    out: list[Top] = []
    for r, lse in enumerate(lses):
        at: dict[str, Any] = {}
        if target is not None:
            t = x[r, target]
            at = {
                "target_prob": float(probs[r, target]),
                "target_rank": int(ranks[r]),
                "target_logprob": float(t.double() - lse),
            }
        logprobs = (x[r, ids[r]].double() - lse).tolist()
        out.append(Top(ids[r].tolist(), probs[r, ids[r]].tolist(), logprobs, **at, stats=stats[r]))
    return out


def exact_top1(logits: torch.Tensor, real_vocab: int) -> list[Top]:
    """`exact_tops` with k = 1 and no target, for many rows at once (the grid's cells): the same
    values (the lowest id of the highest logit, its softmax probability, its log-probability in
    float64), with each row reduced on its own but no Python work per row beyond its `Top`."""
    import torch

    x = logits.float()
    top = x[:, :real_vocab].argmax(dim=-1, keepdim=True)  # the first of equal logits
    probs = torch.softmax(x, dim=-1).gather(1, top)[:, 0].tolist()
    blocks = range(0, x.shape[0], LSE_ROWS)
    lse = torch.cat([torch.logsumexp(x[i : i + LSE_ROWS].double(), dim=-1) for i in blocks])
    logprobs = (x.gather(1, top)[:, 0].double() - lse).tolist()
    ids = top[:, 0].tolist()
    return [Top([i], [p], [lp]) for i, p, lp in zip(ids, probs, logprobs, strict=True)]


def tops_from_log_softmax(
    x: torch.Tensor,
    lx: torch.Tensor,
    k: int,
    real_vocab: int,
    targets: Sequence[int | None],
    nexts: Sequence[int | None] | None = None,
) -> list[Top]:
    """The ranking of `exact_tops` for many rows at once, probabilities and log-probabilities read
    from `lx` (the rows' log_softmax over the whole output), each row with its own target and
    next token."""
    import torch

    real = x[:, :real_vocab]
    ids = best(real, k)
    chosen = lx.gather(1, ids)
    rows = [r for r, t in enumerate(targets) if t is not None]
    at: dict[int, tuple[float, int, float]] = {}
    if rows:
        tids = [int(t) for t in targets if t is not None]
        ranks = target_ranks(x, real, rows, tids)
        lp = lx[torch.tensor(rows, device=x.device), torch.tensor(tids, device=x.device)]
        probs, logprobs = lp.exp().tolist(), lp.tolist()
        at = {r: (probs[j], int(ranks[j]), logprobs[j]) for j, r in enumerate(rows)}
    id_rows, logprob_rows, prob_rows = ids.tolist(), chosen.tolist(), chosen.exp().tolist()
    stats = row_stats(x, real_vocab, targets, nexts)
    out = []
    for r in range(x.shape[0]):
        prob, rank, logprob = at.get(r, (None, None, None))
        out.append(Top(id_rows[r], prob_rows[r], logprob_rows[r], prob, rank, logprob, stats[r]))
    return out


def rowdot(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Σ a·b along the last dimension of each row, [n, V] x [n, V] -> [n]. torch's sum adds in
    blocks; a BLAS dot product (bmm) adds 10^5 float32 terms in a row and moved a KL of 99.53
    nats by 0.01 against float64. One row is summed on one thread (`one_thread`): torch splits
    a reduction to a single value between threads, and its last bits would follow their count.
    `out`: an [n, V] buffer the products are written to (the same figures, no fresh array)."""
    import torch

    from embedlens.analysis.lens.blocks import one_thread

    with nullcontext() if a.shape[0] > 1 else one_thread():
        return (a * b if out is None else torch.mul(a, b, out=out)).sum(dim=-1)


class Reference:
    """The model's own output at the rows of a batch, against which each decoded row's KL(model's
    output ‖ row) is taken: its log-probabilities, and Σ p log p of each row (minus its entropy)."""

    def __init__(self, real: torch.Tensor) -> None:
        import torch

        self.log = torch.log_softmax(real, dim=-1)
        self.prob = self.log.exp()
        self.negent = rowdot(self.prob, self.log)

    def kl_entropy(self, refs: list[int], lx: torch.Tensor) -> tuple[list[float], list[float]]:
        """KL(model's output at row refs[j] ‖ row j) and the entropy of each row of log_softmax
        `lx`. Σ p log p of each row is one dot product per row (no [rows, V] product is stored)."""
        import torch

        negent = rowdot(lx.exp(), lx)
        cross = self._cross(refs, lx)
        kl = (self.negent[torch.tensor(refs)].to(lx.device) - cross).clamp_min(0.0).tolist()
        return kl, (-negent).tolist()

    def _cross(self, refs: list[int], lx: torch.Tensor) -> torch.Tensor:
        """Σ p log q of each row: p the model's output at row refs[j], log q row j of `lx`.
        A chunk reads the model's rows in runs of consecutive rows (one layer's rows in order),
        so each run multiplies a slice of them: no [rows, V] copy of the model's rows."""
        import torch

        out = torch.empty(len(refs), dtype=lx.dtype, device=lx.device)
        j = 0
        while j < len(refs):
            end = j + 1
            while end < len(refs) and refs[end] == refs[end - 1] + 1:
                end += 1
            p = self.prob[refs[j] : refs[j] + end - j].to(lx.device)
            out[j:end] = rowdot(p, lx[j:end])
            j = end
        return out
