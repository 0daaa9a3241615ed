"""The three under-trained signals over one matrix's rows (`scan_matrix`), and what a scan is
given: the matrices (`Matrix`) and what the vocabulary says of their rows (`Tokens`).

- `indicator`: the cosine of a row, its first principal component removed (`component`), to
  the mean of the rows known unused (`ReferenceRows`); at or above their 99th percentile.
- `norm`: a robust score of the log norm against the ordinary rows'; NORM_Z deviations.
- `mean`: a row within MEAN_RATIO of the ordinary rows' median distance to the rows' mean.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from embedlens.analysis.vocab.component import Aside, Found, begin_component
from embedlens.analysis.vocab.kinds import TokenKinds
from embedlens.analysis.vocab.passes import RowStats, identical_rows, row_stats
from embedlens.model.matrix import Rows
from embedlens.model.tokenizer import Vocab
from embedlens.reports.vocab import (
    MatrixScan,
)

PERCENTILE = 99.0
THRESHOLD_RULE = "at or above the 99th percentile of the reference rows' indicator"
NORM_Z = 6.0
"""Robust deviations of the log norm that flag a row. On SmolLM2 the trained rows lie within
-3.2 and +4.9, a row at initialisation scale (norm 0.48 against a median of 3.15) at -10.5."""
MAD_SCALE = 1.4826  # MAD x this estimates a normal spread's standard deviation
MIN_SPREAD = 1e-3  # of the log norm: rows of one norm (normalised tables) still score finitely
MEAN_RATIO = 0.1
"""A row this close to the rows' mean (over the ordinary rows' median distance) is flagged. On
SmolLM2 the closest trained row is at 0.73; a mean-resized row at about 1/sqrt(rows sampled)."""
SIGNALS = ("indicator", "norm", "mean")


@dataclass(frozen=True)
class ReferenceRows:
    """Rows known unused, with why: 'padding', 'single_byte', 'shadowed', 'named_unused', ..."""

    kinds: TokenKinds

    @property
    def ids(self) -> list[int]:
        """The rows, sorted."""
        return [int(i) for i in self.kinds.ids]


@dataclass(frozen=True)
class Matrix:
    """One matrix to scan: its rows, its tensor's name, and 'input' or 'output'; `early`, its
    component when begun before the scan (`Matrix.begun`)."""

    rows: Rows
    tensor: str
    which: str
    early: Aside[Found] | None = None

    @classmethod
    def begun(cls, rows: Rows, tensor: str, which: str) -> Matrix:
        """The matrix, its component begun on a thread of its own (`begin_component`)."""
        return cls(rows, tensor, which, begin_component(rows))


@dataclass(frozen=True)
class Tokens:
    """What the vocabulary says of the rows: known unused (reference), tokens that are not
    ordinary (special, added or unreachable), and groups of rows added at the end."""

    reference: ReferenceRows
    unreachable: Collection[int] | npt.NDArray[np.int64]
    special_or_added: frozenset[int]
    groups: list[tuple[str, list[int]]]
    """('added_tokens' or 'past_tokenizer', ids)."""

    def arrays(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """The reference rows, sorted, and the tokens that are not ordinary, as arrays."""
        others = [
            np.asarray(ids, dtype=np.int64)
            if isinstance(ids, np.ndarray)
            else np.fromiter(ids, dtype=np.int64, count=len(ids))
            for ids in (self.unreachable, self.special_or_added)
        ]
        return self.reference.kinds.ids, np.concatenate(others)


@dataclass(frozen=True)
class Scanned:
    """One matrix's figures and, per signal, which of its rows that signal flags."""

    report: MatrixScan
    stats: RowStats
    score: npt.NDArray[np.float64]
    ratio: npt.NDArray[np.float64]
    flags: dict[str, npt.NDArray[np.bool_]]
    """Per signal, over every row: the indicator never flags a reference row."""


def scan_matrix(matrix: Matrix, vocab: Vocab, tokens: Tokens, *, all_tokens: bool) -> Scanned:
    """The three signals over one matrix's rows, with what the vocabulary says of them. The
    identical rows and the long lists are found meanwhile, on a pool of two threads that has
    ended when this returns or raises."""
    rows = matrix.rows
    v = rows.shape[0]
    reference, not_ordinary = tokens.arrays()
    ref_ids = reference[: np.searchsorted(reference, v)]
    stats = row_stats(rows, ref_ids, matrix.early)
    real = min(vocab.size, v)
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="embedlens-signals") as pool:
        same = pool.submit(identical_rows, rows, stats.signature, real)
        lists = pool.submit(_lists, stats) if all_tokens else None
        return _signals(matrix, stats, ref_ids, not_ordinary, real, (same, lists))


def _signals(
    matrix: Matrix,
    stats: RowStats,
    ref_ids: npt.NDArray[np.int64],
    not_ordinary: npt.NDArray[np.int64],
    real: int,
    aside: tuple[Future[list[list[int]]], Future[tuple[list[float], list[float]]] | None],
) -> Scanned:
    """`scan_matrix` once the rows' figures are in (`aside`: the identical rows, the lists)."""
    values, norms = stats.indicator, stats.norms
    v = values.shape[0]
    is_ref = np.zeros(v, dtype=bool)
    is_ref[ref_ids] = True
    ordinary = ~is_ref
    ordinary[real:] = False
    ordinary[not_ordinary[not_ordinary < real]] = False
    threshold: float | None = None
    ref_values = values[ref_ids]
    ref_values = ref_values[np.isfinite(ref_values)]
    if ref_values.size:
        threshold = float(np.percentile(ref_values, PERCENTILE))
    flags = {"indicator": np.zeros(v, dtype=bool)}
    if threshold is not None:
        with np.errstate(invalid="ignore"):
            flags["indicator"] = (values >= threshold) & ~is_ref
    norm = _norm_signal(norms, ordinary)
    mean = _mean_signal(stats.mean_distance, ordinary)
    flags["norm"], flags["mean"] = norm.flags, mean.flags
    candidate = ~is_ref
    candidate[real:] = False
    indicators, listed_norms = aside[1].result() if aside[1] is not None else (None, None)
    report = MatrixScan(
        matrix=matrix.which,
        tensor=matrix.tensor,
        threshold=threshold,
        threshold_rule=THRESHOLD_RULE if threshold is not None else "no reference rows",
        component=stats.component,
        norm_median=float(np.median(norms[:real])) if real else 0.0,
        reference_norm_median=float(np.median(norms[ref_ids])) if ref_ids.size else None,
        identical_rows=aside[0].result(),
        norm_rule=norm.rule,
        norm_low=norm.low,
        norm_high=norm.high,
        ordinary_rows=int(ordinary.sum()),
        ordinary_norm_median=norm.median,
        mean_rule=mean.rule,
        mean_distance_median=mean.median,
        flagged={k: int((f & candidate).sum()) for k, f in flags.items()},
        indicators=indicators,
        norms=listed_norms,
    )
    return Scanned(report, stats, norm.score, mean.score, flags)


@dataclass(frozen=True)
class _Signal:
    """One signal over every row: what flags a row, and the figures the rule states."""

    flags: npt.NDArray[np.bool_]
    rule: str
    median: float | None
    score: npt.NDArray[np.float64]
    low: float | None = None
    high: float | None = None


def _norm_signal(norms: npt.NDArray[np.float32], ordinary: npt.NDArray[np.bool_]) -> _Signal:
    """Rows whose log norm is NORM_Z robust deviations or more from the ordinary rows' median
    (an all-zero row's is -inf: flagged; a row holding NaN is left out of the median)."""
    with np.errstate(divide="ignore"):
        logs = np.log(norms.astype(np.float64))
    centre = float(np.nanmedian(logs[ordinary])) if ordinary.any() else math.nan
    if not math.isfinite(centre):
        nothing = np.zeros(norms.shape[0], dtype=bool)
        score = np.full(norms.shape[0], np.nan)
        return _Signal(nothing, "no reachable ordinary rows, no norm signal", None, score)
    spread = max(MAD_SCALE * float(np.nanmedian(np.abs(logs[ordinary] - centre))), MIN_SPREAD)
    low, high = math.exp(centre - NORM_Z * spread), math.exp(centre + NORM_Z * spread)
    score = (logs - centre) / spread
    flags = np.abs(score) >= NORM_Z
    n = int(ordinary.sum())
    rule = (
        f"at or below {low:.3g} or at or above {high:.3g} ({NORM_Z:g} robust deviations of the "
        f"log norm from the median, {math.exp(centre):.3g}, of {n:,} reachable ordinary rows)"
    )
    return _Signal(flags, rule, math.exp(centre), score, low, high)


def _mean_signal(distance: npt.NDArray[np.float64], ordinary: npt.NDArray[np.bool_]) -> _Signal:
    """Rows within MEAN_RATIO of the ordinary rows' median distance to the rows' mean."""
    median = float(np.nanmedian(distance[ordinary])) if ordinary.any() else 0.0
    if not median > 0.0:
        nothing = np.zeros(distance.shape[0], dtype=bool)
        score = np.full(distance.shape[0], np.nan)
        return _Signal(nothing, "no reachable ordinary rows, no mean signal", None, score)
    ratio = distance / median
    rule = (
        f"within {MEAN_RATIO:.0%} of the ordinary rows' median distance to the rows' mean "
        f"({median:.3g})"
    )
    return _Signal(ratio <= MEAN_RATIO, rule, median, ratio)


def _lists(stats: RowStats) -> tuple[list[float], list[float]]:
    """Every row's indicator and norm as lists (`_listed`)."""
    return _listed(stats.indicator), _listed(stats.norms)


def _listed(values: npt.NDArray[np.float32]) -> list[float]:
    """Every row's value to 6 decimals (float32 holds about 7 digits; a 262k-row list prints in a
    fraction of the time full-length floats take)."""
    return list(np.round(values.astype(np.float64), 6).tolist())
