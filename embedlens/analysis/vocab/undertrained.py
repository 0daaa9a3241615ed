"""Under-trained tokens, after Land and Bartolo, "Fishing for Magikarp" (2024, arXiv 2405.05417),
and rows that never moved from where they started.

Three stated signals, each over every row of a matrix:

- `indicator` (Magikarp's for tied and output matrices): rows that training never moved share a
  direction, as the softmax pushes every unused row of the head the same way. The indicator of a
  token is the cosine of its row, with the matrix's first principal component removed (a
  direction all rows share), to the mean of rows known to be unused: padding rows, tokens the
  tokenizer never produces as themselves, tokens the vocabulary names unused. Tokens at or above
  the reference rows' own 99th percentile are candidates.
- `norm`: a row left at its random start (or pulled to zero by weight decay) points nowhere in
  particular, which the indicator cannot see, but its norm is far from the trained rows'. The
  score is a robust one, of the log norm against the median and MAD of the reachable ordinary
  tokens' rows (neither special, added, unreachable nor reference rows); NORM_Z deviations either
  way flag a row.
- `mean`: transformers' `resize_token_embeddings` (mean_resizing) starts new rows at the mean of
  the others; a row within MEAN_RATIO of the ordinary rows' median distance to the rows' mean is
  flagged.

An untied model's embedding and head are scanned alike, and each candidate says which matrix
flagged it. Rows that are exactly equal to each other are listed too: training would have moved
them apart. Groups of rows added at the end of the table (added tokens past the last ordinary id,
rows past the tokenizer) get a verdict of their own.

The first principal component comes from a sample of the rows, read apart (`begin_component`: on a
thread of its own, begun while the caller reads the tokenizer). The matrix is then read block by
block (a float32 piece at a time, never the whole matrix), by one thread per core, each over its
own share of the rows (numpy's products release the interpreter's lock): once for the reference
rows' mean when they are too many to take one by one, once for the products. Everything else is a
vector of V or a [d, d] matrix.

Here: the scan over every matrix, its candidates ranked and taken in turns. Its parts: the
component (`component`), the passes over the rows (`passes`), the signals (`signals`), the groups
at the end of the table (`groups`).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from embedlens.analysis.vocab.groups import row_groups
from embedlens.analysis.vocab.signals import SIGNALS, Matrix, Scanned, Tokens, scan_matrix
from embedlens.model.tokenizer import Vocab
from embedlens.reports.vocab import (
    Candidate,
    RowFigures,
    Undertrained,
)


def scan(matrices: list[Matrix], vocab: Vocab, tokens: Tokens, *, all_tokens: bool) -> Undertrained:
    """Every signal over every matrix given (the head first, or the tied embedding alone), the
    candidates of all of them, and the groups' verdicts."""
    reference = tokens.reference.kinds.ids
    scanned = [scan_matrix(m, vocab, tokens, all_tokens=all_tokens) for m in matrices]
    main = scanned[0]
    v = min(s.flags["norm"].shape[0] for s in scanned)
    real = min(vocab.size, v)
    ref_ids = reference[: np.searchsorted(reference, main.flags["norm"].shape[0])]
    is_ref = np.zeros(real, dtype=bool)
    is_ref[ref_ids[ref_ids < real]] = True
    order = _taking_turns(scanned, real, is_ref)
    candidates = [_candidate(i, vocab, scanned) for i in order]
    by_kind = tokens.reference.kinds.counts(below=main.flags["norm"].shape[0])
    counts = {
        "reference": len(ref_ids),
        "candidate": len(candidates),
        "ok": real - len(candidates) - int(is_ref.sum()),
    }
    head = main.report
    return Undertrained(
        matrix=head.matrix,
        tensor=head.tensor,
        reference_count=len(ref_ids),
        reference_by_kind=dict(sorted(by_kind.items())),
        threshold=head.threshold,
        threshold_rule=head.threshold_rule,
        component=head.component,
        counts=counts,
        norm_median=head.norm_median,
        reference_norm_median=head.reference_norm_median,
        identical_rows=head.identical_rows,
        candidates=candidates,
        verified=0,
        indicators=head.indicators,
        norms=head.norms,
        norm_rule=head.norm_rule,
        norm_low=head.norm_low,
        norm_high=head.norm_high,
        ordinary_rows=head.ordinary_rows,
        ordinary_norm_median=head.ordinary_norm_median,
        mean_rule=head.mean_rule,
        mean_distance_median=head.mean_distance_median,
        flagged=head.flagged,
        by_signal={k: sum(k in c.signals for c in candidates) for k in SIGNALS},
        input=scanned[1].report if len(scanned) > 1 else None,
        one_matrix=_one_matrix(candidates) if len(scanned) > 1 else None,
        groups=row_groups(tokens.groups, v, scanned),
    )


def _taking_turns(scanned: list[Scanned], real: int, is_ref: npt.NDArray[np.bool_]) -> list[int]:
    """Candidate ids, each signal's list (strongest first: highest indicator, norm furthest from
    the median, closest to the mean) taking turns, the matrices in turn within a signal: the
    first few (and --verify's) hold every signal's strongest."""
    lists: list[list[int]] = []
    for signal in SIGNALS:
        lists.extend(_ranked(s, signal, real, is_ref) for s in scanned)
    seen: set[int] = set()
    order: list[int] = []
    for k in range(max((len(ids) for ids in lists), default=0)):
        for ranked in lists:
            if k < len(ranked) and ranked[k] not in seen:
                seen.add(ranked[k])
                order.append(ranked[k])
    return order


def _ranked(s: Scanned, signal: str, real: int, is_ref: npt.NDArray[np.bool_]) -> list[int]:
    """The real tokens one signal flags in one matrix, strongest first (ties by id)."""
    ids = np.flatnonzero(s.flags[signal][:real] & ~is_ref)
    if signal == "indicator":
        key = -s.stats.indicator[ids].astype(np.float64)
    elif signal == "norm":
        key = -np.abs(s.score[ids])
    else:
        key = s.ratio[ids]
    return [int(i) for i in ids[np.lexsort((ids, key))]]


def _figures(s: Scanned, i: int) -> RowFigures:
    return RowFigures(
        indicator=float(s.stats.indicator[i]),
        norm=float(s.stats.norms[i]),
        norm_score=float(s.score[i]),
        mean_distance=float(s.ratio[i]),
        signals=[k for k in SIGNALS if s.flags[k][i]],
    )


def _candidate(i: int, vocab: Vocab, scanned: list[Scanned]) -> Candidate:
    rows = [_figures(s, i) for s in scanned]
    head = rows[0]
    return Candidate(
        id=i,
        token=vocab.text(i),
        indicator=head.indicator,
        norm=head.norm,
        special=i in vocab.special_ids,
        repeat_prob=None,
        verdict="candidate",
        signals=[k for k in SIGNALS if any(k in r.signals for r in rows)],
        by_matrix={s.report.matrix: r.signals for s, r in zip(scanned, rows, strict=True)},
        norm_score=head.norm_score,
        mean_distance=head.mean_distance,
        input=rows[1] if len(rows) > 1 else None,
    )


def _one_matrix(candidates: list[Candidate]) -> dict[str, int]:
    """Candidates whose rows disagree: flagged in one matrix only."""
    out = {"input": 0, "output": 0}
    for c in candidates:
        flagged = [m for m, signals in c.by_matrix.items() if signals]
        if len(flagged) == 1:
            out[flagged[0]] += 1
    return out
