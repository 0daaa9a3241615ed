"""Two models' lenses compared at the rows read: KL between them, A's decoder on B's residual.

Both results come from the engine with `keep`: B's first, then A's with B's residual stream as
`other`, so that A's decoder runs on B's rows in the same chunks as on its own. Every pair of
rows compared was decoded in the same chunks by the same code: equal residuals give equal bits,
and a KL of exactly 0. KL is taken in float64 from the float32 logits, on one thread (a row's
sum split between threads would move its last bits with the machine's load).

A pair's figures as the reports users get (`pair_report`, `pair_summary`): A's `LensReport` with B's `diff`, and the summary's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

from embedlens.analysis.lens.blocks import one_thread
from embedlens.analysis.lens.opening import token_text
from embedlens.analysis.lens.report import LensResult
from embedlens.analysis.lens.stats import Sums, Top, add_row
from embedlens.errors import UnsupportedError
from embedlens.reports.lens import (
    LensCheck,
    LensDiff,
    LensDiffLayer,
    LensDiffLayerStats,
    LensReport,
    LensSummaryDiff,
    LensSummaryReport,
    Prediction,
)

if TYPE_CHECKING:
    from embedlens.analysis.lens.report import LensResult


@dataclass(frozen=True)
class LayerDiff:
    """A against B at one (layer, position)."""

    layer: int
    kl: float
    residual_kl: float
    top1_agree: bool
    target_logprob_delta: float | None
    against: Top
    """B's predictions there."""


def kl_rows(p: torch.Tensor, q: torch.Tensor) -> list[float]:
    """KL(softmax p ‖ softmax q) of each pair of rows of logits [n, V], in nats (float64); q is
    moved to p's device (two models may sit on different devices). Each row's figure depends on
    that row's logits alone (one thread): a row gives the same bits in any stack of rows."""
    with one_thread():
        lp = torch.log_softmax(p.double(), dim=-1)
        lq = torch.log_softmax(q.to(p.device).double(), dim=-1)
        terms = lp.exp().mul_(lp - lq)
        if bool(torch.isinf(p).any()):  # logits without an infinity have no log p of -inf
            terms = torch.where(torch.isneginf(lp), 0.0, terms)  # 0 log 0 = 0
        return terms.sum(dim=-1).clamp_min(0.0).tolist()


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether two rows hold the same bits (then any computation on them gives the same)."""
    if x is y:
        return True
    alike = x.dtype == y.dtype and x.shape == y.shape and x.device == y.device
    if not alike or not (x.is_contiguous() and y.is_contiguous()):
        return False
    return bool(torch.equal(x.view(torch.uint8), y.view(torch.uint8)))


def compare(a: LensResult, b: LensResult, position: int) -> list[LayerDiff]:
    """Every layer of A's result against B's at one position both read (on one thread: copying
    a few rows is too little work to share, and each parallel step waits for a busy core)."""
    with one_thread():
        return _compare(a, b, position)


def _compare(a: LensResult, b: LensResult, position: int) -> list[LayerDiff]:
    if a.kept is None or b.kept is None:
        raise ValueError("compare needs both results run with keep=True")
    if a.vocab_size != b.vocab_size:
        raise UnsupportedError(
            f"the two models' outputs differ in size ({a.vocab_size:,} and {b.vocab_size:,} "
            "rows): their predictions cannot be compared token by token"
        )
    n, layers = a.num_layers, a.layers
    lens_a, lens_b = (_lens_rows(r, layers, n, position) for r in (a, b))
    kl = kl_rows(torch.stack(lens_a), torch.stack(lens_b))
    own = [a.kept.logits[(x, position)] for x in layers]
    theirs = [a.kept.other[(x, position)] for x in layers]
    residual_kl = _again(
        kl, list(zip(lens_a, lens_b, strict=True)), list(zip(own, theirs, strict=True))
    )
    out = []
    for i, x in enumerate(layers):
        top_a, top_b = a.rows[(x, position)], b.rows[(x, position)]
        delta = None
        if top_a.target_logprob is not None and top_b.target_logprob is not None:
            delta = top_b.target_logprob - top_a.target_logprob
        agree = top_a.ids[0] == top_b.ids[0]
        out.append(LayerDiff(x, kl[i], residual_kl[i], agree, delta, top_b))
    return out


def _lens_rows(r: LensResult, layers: list[int], n: int, position: int) -> list[torch.Tensor]:
    """The lens row of each layer at a position: its kept logits, the model's own at layer n
    (which a states file without the last layer does not ask for)."""
    kept = r.kept
    assert kept is not None

    def row(x: int) -> torch.Tensor:
        out = r.output_at(position) if x == n else kept.logits[(x, position)]
        assert out is not None
        return out

    return [row(x) for x in layers]


Rows = list[tuple[torch.Tensor, torch.Tensor]]
"""(p, q) rows of logits, one pair per layer."""


def _again(kl: list[float], done: Rows, rows: Rows) -> list[float]:
    """`kl_rows` of the pairs `rows`, taking the figure of `done`'s pair at the same layer
    where both rows hold the same bits as that pair's (A's own rows are its lens rows below
    the last layer; B's residual through A's decoder is B's lens where their tails match)."""
    out = list(kl)
    todo = [i for i, ((p, q), (p0, q0)) in enumerate(zip(rows, done, strict=True))
            if not (same_bits(p, p0) and same_bits(q, q0))]  # fmt: skip
    if todo:
        p, q = (torch.stack([rows[i][j] for i in todo]) for j in (0, 1))
        for i, value in zip(todo, kl_rows(p, q), strict=True):
            out[i] = value
    return out


def first_above(layers: Sequence[int], kls: Sequence[float], threshold: float) -> int | None:
    """The first layer whose KL exceeds the threshold (a NaN never does), or None."""
    return next((x for x, kl in zip(layers, kls, strict=True) if kl > threshold), None)


PAIR_STATS = tuple(f.name for f in fields(LensDiffLayerStats) if f.name != "layer")
"""The statistics of a pair's `--prompts` summary rows."""


@dataclass
class PairStats:
    """Sums per layer of A against B, added to one prompt at a time (every position read)."""

    layers: dict[int, Sums] = field(default_factory=dict)
    n_against_unfaithful: int = 0

    def add(self, a: LensResult, b: LensResult, read: int) -> list[LayerDiff]:
        """One prompt's results, compared at every position both read; the comparison at the
        position `read` (its report's)."""
        self.n_against_unfaithful += int(not b.check.ok)
        shown: list[LayerDiff] = []
        for position in a.positions:
            diffs = compare(a, b, position)
            if position == read:
                shown = diffs
            for d in diffs:
                acc = self.layers.setdefault(d.layer, Sums())
                acc.add("kl", d.kl)
                acc.add("residual_kl", d.residual_kl)
                acc.add("top1_agreement", int(d.top1_agree))
                if d.target_logprob_delta is not None:
                    acc.add("target_logprob_delta", d.target_logprob_delta)
                add_row(acc, d.against.stats, "against_")
        return shown

    def means(self) -> list[dict[str, Any]]:
        """The statistics of `PAIR_STATS` per layer, in layer order (with `layer`)."""
        return [{"layer": x, **acc.values(PAIR_STATS)} for x, acc in sorted(self.layers.items())]


def pair_report(
    report: LensReport,
    diffs: list[LayerDiff],
    b: LensResult,
    against: str,
    threshold: float,
    tokenizer: Any,
    notes: list[str],
    shown: list[int] | None = None,
) -> LensReport:
    """A's report with, in `diff`, B against it at the position the report reads (`diffs`, from
    `pair.compare`; `b`: B's result); `notes` (B's) follow A's. `shown`: the layers the report
    holds when `diffs` has more (the first divergent layer is found among all of `diffs`)."""
    cache: dict[int, str] = {}

    def tok(i: int) -> str:
        if i not in cache:
            cache[i] = token_text(tokenizer, i)
        return cache[i]

    layers = [
        LensDiffLayer(
            layer=d.layer,
            kl=d.kl,
            top1_agree=d.top1_agree,
            residual_kl=d.residual_kl,
            target_logprob_delta=d.target_logprob_delta,
            against_top=[
                Prediction(i, tok(i), p, lp)
                for i, p, lp in zip(d.against.ids, d.against.probs, d.against.logprobs, strict=True)
            ],
            **{f"against_{name}": value for name, value in d.against.stats.items()},
        )
        for d in diffs
        if shown is None or d.layer in shown
    ]
    first = first_above([d.layer for d in diffs], [d.kl for d in diffs], threshold)
    c = b.check
    check = LensCheck(c.max_abs_logit_diff, c.tolerance, c.ok, c.top1_agrees, c.suspect)
    diff = LensDiff(against, threshold, first, layers, check)
    return dataclasses.replace(report, notes=[*report.notes, *notes], diff=diff)


def pair_summary(
    summary: LensSummaryReport,
    stats: PairStats,
    against: str,
    threshold: float,
    notes: list[str],
    shown: list[int] | None = None,
) -> LensSummaryReport:
    """A's summary with, in `diff`, the per-layer means of B against it. `shown`: the layers the
    summary holds when `stats` has more (the first divergent layer is found among all)."""
    every = [LensDiffLayerStats(**row) for row in stats.means()]
    first = first_above([x.layer for x in every], [x.kl for x in every], threshold)
    layers = [x for x in every if shown is None or x.layer in shown]
    diff = LensSummaryDiff(against, threshold, first, layers, stats.n_against_unfaithful)
    return dataclasses.replace(summary, notes=[*summary.notes, *notes], diff=diff)
