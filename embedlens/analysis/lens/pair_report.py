"""A pair's figures as the reports users get: A's `LensReport` with B's `diff`, and the summary."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from embedlens.analysis.lens.pair import LayerDiff, PairStats, first_above
from embedlens.analysis.lens.prompt import token_text
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
    from embedlens.analysis.lens.engine import LensResult


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
