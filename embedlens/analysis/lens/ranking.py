"""Decoded rows reduced to what a report shows: the best tokens by logit, and a target's rank.

One ranking for every run: the k real tokens of highest logit, equal logits in id order, and a
target's rank (1 + the real tokens above it: a higher logit, or the same and a lower id). Two
sources of probabilities: `exact_tops` for one prompt (the softmax in float32 as the model computes
it, log-probabilities in float64: never -inf) and `tops_from_log_softmax` for a batch (from the
rows' float32 log_softmax, which the batch computes anyway for its KL statistics).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from embedlens.analysis.lens.blocks import one_thread
from embedlens.analysis.lens.stats import RowValues, row_stats, target_ranks

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
    """The row's `stats.ROW_STATS`, by name."""


def best_ids(row: torch.Tensor, kth: torch.Tensor, k: int) -> torch.Tensor:
    """The k ids of highest logit in one row, best first, equal logits in id order; `kth` is the
    k-th highest logit."""
    candidates = (row >= kth).nonzero().flatten()  # in id order: a stable sort keeps it
    order = torch.sort(row[candidates], descending=True, stable=True).indices[:k]
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
    order = torch.sort(real.gather(1, by_id), dim=-1, descending=True, stable=True).indices
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
    x = logits.float()
    probs = torch.softmax(x, dim=-1)
    real = x[:, :real_vocab]
    ids = best(real, k)
    with one_thread():  # a reduction to one value is split between threads: same bytes on any
        lses = [torch.logsumexp(x[r].double(), dim=-1) for r in range(x.shape[0])]
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
    with nullcontext() if a.shape[0] > 1 else one_thread():
        return (a * b if out is None else torch.mul(a, b, out=out)).sum(dim=-1)
