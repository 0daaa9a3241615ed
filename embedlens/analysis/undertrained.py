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
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from embedlens.analysis.token_kinds import TokenKinds
from embedlens.model.matrix import Rows
from embedlens.model.tokenizer import Vocab
from embedlens.reports.vocab import (
    Candidate,
    GroupMatrix,
    MatrixScan,
    RowFigures,
    RowGroup,
    Undertrained,
)

PERCENTILE = 99.0
SAMPLE_ROWS = 16384
EXACT_WIDTH = 256  # covariances up to this width are decomposed exactly (milliseconds)
LANCZOS_TOL = 1e-9
CHECK_EVERY = 8  # Lanczos steps between residual checks
THRESHOLD_RULE = "at or above the 99th percentile of the reference rows' indicator"
MAX_WORKERS = 8
SHARE_ROWS = 16384  # rows a thread takes at least (fewer go on one thread)
PIECE_VALUES = 1 << 19
"""Float32 values (2 MiB) in a piece of a pass's block, at least: a larger block (the 16 MiB of a
type read through gguf's formulas) is read and multiplied a piece at a time, while it is in
cache. Pieces this large keep the block's figures: OpenBLAS's small-matrix kernels, which it
takes below 10^6 multiply-adds on AVX-512, sum in another order, and a piece's product by three
vectors is above that."""
NORM_Z = 6.0
"""Robust deviations of the log norm that flag a row. On SmolLM2 the trained rows lie within
-3.2 and +4.9, a row at initialisation scale (norm 0.48 against a median of 3.15) at -10.5."""
MAD_SCALE = 1.4826  # MAD x this estimates a normal spread's standard deviation
MIN_SPREAD = 1e-3  # of the log norm: rows of one norm (normalised tables) still score finitely
MEAN_RATIO = 0.1
"""A row this close to the rows' mean (over the ordinary rows' median distance) is flagged. On
SmolLM2 the closest trained row is at 0.73; a mean-resized row at about 1/sqrt(rows sampled)."""
SIGNALS = ("indicator", "norm", "mean")
T = TypeVar("T")
Found = tuple[npt.NDArray[np.float64], str, npt.NDArray[np.float64]]
"""A first principal component, how it was found, and the rows' mean (`component`)."""


@dataclass(frozen=True)
class ReferenceRows:
    """Rows known unused, with why: 'padding', 'single_byte', 'shadowed', 'named_unused', ..."""

    kinds: TokenKinds

    @property
    def ids(self) -> list[int]:
        """The rows, sorted."""
        return [int(i) for i in self.kinds.ids]


@dataclass(frozen=True)
class RowStats:
    """Per-row figures from one pass over the matrix (float32 vectors of V)."""

    indicator: npt.NDArray[np.float32]
    norms: npt.NDArray[np.float32]
    signature: npt.NDArray[np.float32]
    """Each row's product with a fixed random vector: equal rows have equal signatures."""
    component: str
    """How the first principal component was found."""
    mean_distance: npt.NDArray[np.float64]
    """Each row's distance to the mean of the rows sampled for the component."""


def first_component(rows: Rows) -> tuple[npt.NDArray[np.float64], str]:
    """The unit first principal component of the rows (of the centred covariance), and how it
    was found (`component`)."""
    u, how, _ = component(rows)
    return u, how


def component(rows: Rows) -> Found:
    """The unit first principal component of the rows, how it was found, and the rows' mean.

    Estimated from at most SAMPLE_ROWS evenly spaced rows (`sample_stride`): the direction all
    rows share is dominant, and the full [d, V] x [V, d] product would cost seconds on a large
    vocabulary."""
    v = rows.shape[0]
    return component_of(rows.take(list(range(0, v, sample_stride(v)))), v)


class Aside(Generic[T]):
    """`work(*args)` on a thread of its own (a pool of one, `concurrent.futures`), begun now,
    while the caller goes on: numpy's and BLAS's loops release the interpreter's lock, so the two
    overlap."""

    def __init__(self, name: str, work: Callable[..., T], *args: Any) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"embedlens-{name}")
        self._future = self._pool.submit(work, *args)

    def result(self) -> T:
        """What `work` returned, once the thread has ended (what it raised, if it raised)."""
        self._pool.shutdown(wait=True)
        return self._future.result()

    def wait(self) -> None:
        """End the thread, whatever it gave (a call that failed elsewhere leaves none)."""
        self._pool.shutdown(wait=True)


def begin_component(rows: Rows) -> Aside[Found]:
    """`component(rows)` begun on a thread of its own, before the caller needs it: its sample
    (every `sample_stride`-th row) asks nothing of the vocabulary, so the covariance's product
    runs while the tokenizer is read."""
    return Aside("component", component, rows)


def sample_stride(v: int) -> int:
    """Every how many rows the component's sample takes one (from row 0): SAMPLE_ROWS at most."""
    return max(1, -(-v // SAMPLE_ROWS))


def component_of(sample: npt.NDArray[np.float32], v: int) -> Found:
    """`component` from the sampled rows (of v). A narrow covariance is decomposed exactly
    (eigh); a wider one by Lanczos (top_eigenvector), which needs a few dozen [d, d] products
    where eigh costs seconds at d = 896."""
    mean = sample.mean(axis=0, dtype=np.float64)
    gram = (sample.T @ sample).astype(np.float64) / sample.shape[0]
    covariance = gram - np.outer(mean, mean)
    of = f"{sample.shape[0]:,} of {v:,} rows" if sample.shape[0] < v else f"all {v:,} rows"
    if covariance.shape[0] <= EXACT_WIDTH:
        _, vectors = np.linalg.eigh(covariance)
        u = np.asarray(vectors[:, -1], dtype=np.float64)
        return u, f"eigendecomposition of {of}", mean
    u, steps, residual = top_eigenvector(covariance)
    how = f"Lanczos on the covariance of {of}, {steps} steps, relative residual {residual:.1e}"
    return u, how, mean


def top_eigenvector(
    a: npt.NDArray[np.float64], tol: float = LANCZOS_TOL
) -> tuple[npt.NDArray[np.float64], int, float]:
    """The unit eigenvector of a symmetric positive semi-definite matrix's largest eigenvalue,
    the Lanczos steps taken and the relative residual |a y - t y| / t reached.

    Lanczos with full reorthogonalisation from a fixed start: it stops when the residual is
    below `tol` (the angle to the true vector is at most the residual over the gap to the second
    eigenvalue), and is exact after d steps."""
    d = a.shape[0]
    basis = np.zeros((d + 1, d))
    start = np.random.default_rng(0).standard_normal(d)
    basis[0] = start / np.linalg.norm(start)
    alphas: list[float] = []
    betas: list[float] = []
    for k in range(d):
        w = a @ basis[k]
        alphas.append(float(w @ basis[k]))
        for _ in range(2):  # twice is enough to keep the basis orthogonal in floating point
            w -= basis[: k + 1].T @ (basis[: k + 1] @ w)
        beta = float(np.linalg.norm(w))
        last = k + 1 == d or beta == 0.0
        if (k + 1) % CHECK_EVERY == 0 or last:  # each check is an eigh of the tridiagonal
            theta, ritz = _top_ritz(alphas, betas)
            residual = beta * abs(float(ritz[-1])) / theta if theta > 0 else 0.0
            if residual <= tol or last:
                y = basis[: k + 1].T @ ritz
                return y / np.linalg.norm(y), k + 1, residual
        betas.append(beta)
        basis[k + 1] = w / beta
    raise AssertionError("unreachable: Lanczos ends after d steps")


def _top_ritz(alphas: list[float], betas: list[float]) -> tuple[float, npt.NDArray[np.float64]]:
    """The largest eigenvalue of the Lanczos tridiagonal matrix and its unit eigenvector."""
    k = len(alphas)
    t = np.diag(alphas)
    if k > 1:
        t += np.diag(betas, 1) + np.diag(betas, -1)
    values, vectors = np.linalg.eigh(t)
    return float(values[-1]), np.asarray(vectors[:, -1], dtype=np.float64)


def workers(v: int) -> int:
    """Threads for a pass over v rows: one per core this process may use, each with at least
    SHARE_ROWS rows."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_WORKERS, v // SHARE_ROWS))


def in_shares(rows: Rows, step: int, work: Callable[[Rows, int, int], None]) -> None:
    """work(rows, start, stop) over contiguous shares of the rows, one thread each (`workers`),
    this thread taking the first; a worker's exception is raised here once all have ended.
    Shares start on multiples of `step`, so the blocks a pass reads are the same whatever the
    threads. Measured on 2 cores, 262,144 x 896 Q8_0 rows times three vectors: 0.22 to 0.32 s
    on one thread, 0.12 to 0.13 s on two."""
    v = rows.shape[0]
    n = workers(v)
    bounds = [min(v, -(-(v * k // n) // step) * step) for k in range(n + 1)]
    errors: list[BaseException] = []
    with ThreadPoolExecutor(
        max_workers=max(1, n - 1), thread_name_prefix="embedlens-share"
    ) as pool:
        shares = [pool.submit(work, rows.twin(), bounds[k], bounds[k + 1]) for k in range(1, n)]
        try:
            work(rows, bounds[0], bounds[1])
        except BaseException as e:  # raised below, once every share has ended
            errors.append(e)
    errors += [e for e in (share.exception() for share in shares) if e is not None]
    if errors:
        raise errors[0]


def reference_mean(
    rows: Rows, reference: list[int] | npt.NDArray[np.int64]
) -> npt.NDArray[np.float64]:
    """The mean of the reference rows: taken one by one when they are few, else summed block by
    block (a vocabulary whose every token is a reference row is not copied whole), the blocks'
    sums added in order whatever the threads (the same figure on any machine)."""
    d = rows.shape[1]
    if len(reference) == 0:
        return np.zeros(d)
    if len(reference) <= SAMPLE_ROWS:
        return np.asarray(rows.take(list(reference)).mean(axis=0, dtype=np.float64))
    return _reference_pass(rows, reference)


def _reference_pass(
    rows: Rows, reference: list[int] | npt.NDArray[np.int64]
) -> npt.NDArray[np.float64]:
    """The reference rows' mean summed block by block (`reference_mean`)."""
    v, d = rows.shape
    weights = np.zeros(v, dtype=np.float32)
    weights[reference] = 1.0
    step = rows.pass_rows
    sums = np.empty((-(-v // step), d), dtype=np.float32)

    def share(own: Rows, first: int, last: int) -> None:
        carried = _Carried(d)
        for start in range(first, last, step):
            total = sums[start // step]
            total[...] = 0.0
            for a, b in pieces(start, min(last, start + step), d):
                carried.add(own, weights, a, b, total)

    in_shares(rows, step, share)
    total = np.zeros(d)
    for block_sum in sums:
        total += block_sum
    return total / len(reference)


def pieces(start: int, stop: int, d: int) -> list[tuple[int, int]]:
    """Rows start..stop of width d as pieces of PIECE_VALUES values or more, the last taking the
    rest; a block too small for two pieces is one."""
    least = -(-PIECE_VALUES // d)
    n = (stop - start) // least
    if n < 2:
        return [(start, stop)]
    bounds = [start + k * least for k in range(n)]
    return list(zip(bounds, [*bounds[1:], stop], strict=True))


class _Carried:
    """A block's weighted sum taken a piece at a time, to the bit the sum over the whole block:
    einsum adds the rows one after another into its output, which starts at zero, so each piece
    is summed behind a first row holding the sum so far, with weight 1 (zero plus that sum is
    that sum: a sum that starts at +0.0 is never -0.0)."""

    def __init__(self, d: int) -> None:
        self.buffer = np.empty((0, d), dtype=np.float32)
        self.weights = np.empty(0, dtype=np.float32)

    def add(
        self,
        rows: Rows,
        weights: npt.NDArray[np.float32],
        start: int,
        stop: int,
        total: npt.NDArray[np.float32],
    ) -> None:
        """Add rows start..stop-1, weighted, to `total`."""
        n = stop - start + 1
        if self.buffer.shape[0] < n:
            self.buffer = np.empty((n, self.buffer.shape[1]), dtype=np.float32)
            self.weights = np.empty(n, dtype=np.float32)
            self.weights[0] = 1.0
        buffer, w = self.buffer[:n], self.weights[:n]
        buffer[0] = total
        w[1:] = weights[start:stop]
        rows.block_into(start, stop, buffer[1:])  # no BLAS call: its threads would spin
        np.einsum("i,ij->j", w, buffer, out=total)


def row_stats(
    rows: Rows, reference: list[int] | npt.NDArray[np.int64], early: Aside[Found] | None = None
) -> RowStats:
    """Indicator, norm, signature and distance to the mean of every row, reading the matrix once,
    block by block (after the reference rows' pass, when they are many), with the component
    `early` found (else found now): cosine to the reference rows' mean with the first principal
    component u removed, from |x - (x.u)u|^2 = |x|^2 - (x.u)^2 and (x - (x.u)u).r = x.r (r is orthogonal to
    u); the distance to the mean m from |x - m|^2 = |x|^2 - 2 x.m + |m|^2, in float64."""
    v, d = rows.shape
    ref = reference_mean(rows, reference)  # while `early` is still being found
    u, how, centre = early.result() if early is not None else component(rows)
    ref = ref - float(ref @ u) * u
    ref_norm = float(np.linalg.norm(ref))
    probe = np.random.default_rng(0).standard_normal(d)
    direction = ref / ref_norm if ref_norm else ref
    # Three columns, and the mean apart: OpenBLAS multiplies by four columns twice as slowly,
    # and by one (a matrix-vector product) faster than by any.
    weights = np.stack([u, direction, probe], axis=1).astype(np.float32)
    mean = centre.astype(np.float32)
    products = np.empty((v, 3), dtype=np.float32)
    to_mean = np.empty(v, dtype=np.float32)
    squares = np.empty(v, dtype=np.float32)
    step = rows.pass_rows

    def share(own: Rows, first: int, last: int) -> None:
        for start in range(first, last, step):
            for a, b in pieces(start, min(last, start + step), d):
                block = own.block(a, b)
                np.matmul(block, weights, out=products[a:b])
                np.matmul(block, mean, out=to_mean[a:b])
                np.einsum("ij,ij->i", block, block, out=squares[a:b])

    in_shares(rows, step, share)
    norms = np.sqrt(squares)
    proj, dots = products[:, 0], products[:, 1]
    residual = np.sqrt(np.maximum(squares - proj * proj, 0.0))
    if ref_norm == 0.0:
        values = np.full(v, np.nan, dtype=np.float32)
    else:
        with np.errstate(divide="ignore", invalid="ignore"):
            values = np.where(residual > 1e-12 * (norms + 1e-30), dots / residual, np.nan)
    m = mean.astype(np.float64)
    apart = squares.astype(np.float64) - 2.0 * to_mean + float(m @ m)
    distance = np.sqrt(np.maximum(apart, 0.0))
    return RowStats(values.astype(np.float32), norms, products[:, 2].copy(), how, distance)


def identical_rows(rows: Rows, signature: npt.NDArray[np.float32], limit: int) -> list[list[int]]:
    """Groups of real tokens' rows (below `limit`) that are exactly equal, largest first: rows
    with equal signatures (in their stable order: by signature, then id), compared in full.
    The signatures some other row shares are found in a plain sort (a third of the time of a
    stable one); only their rows are put in stable order (a few hundred of 262k float32 values
    meet by chance)."""
    real = signature[:limit]
    ordered = np.sort(real)
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]  # sorted; NaN is never among them
    if repeated.size == 0:
        return []
    at = np.minimum(np.searchsorted(repeated, real), repeated.size - 1)
    shared = np.flatnonzero(repeated[at] == real)  # by id
    order = shared[np.argsort(real[shared], kind="stable")]
    sig = real[order]
    same = np.flatnonzero(sig[1:] == sig[:-1])
    if same.size == 0:
        return []
    pairs = [(int(order[k]), int(order[k + 1])) for k in same]
    ids = sorted({i for pair in pairs for i in pair})
    at = {i: k for k, i in enumerate(ids)}
    table = rows.take(ids)
    groups: dict[int, list[int]] = {}
    for a, b in pairs:
        if np.array_equal(table[at[a]], table[at[b]]):
            head = next((h for h, g in groups.items() if a in g), a)
            groups.setdefault(head, [a])
            if b not in groups[head]:
                groups[head].append(b)
    return sorted((sorted(g) for g in groups.values()), key=lambda g: (-len(g), g[0]))


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
class _Scanned:
    """One matrix's figures and, per signal, which of its rows that signal flags."""

    report: MatrixScan
    stats: RowStats
    score: npt.NDArray[np.float64]
    ratio: npt.NDArray[np.float64]
    flags: dict[str, npt.NDArray[np.bool_]]
    """Per signal, over every row: the indicator never flags a reference row."""


def scan_matrix(
    matrix: Matrix,
    vocab: Vocab,
    reference: npt.NDArray[np.int64],
    not_ordinary: npt.NDArray[np.int64],
    *,
    all_tokens: bool,
) -> _Scanned:
    """The three signals over one matrix's rows (`reference` sorted, as Tokens.arrays gives).
    The identical rows and the long lists are found on threads of their own meanwhile."""
    rows = matrix.rows
    v = rows.shape[0]
    ref_ids = reference[: np.searchsorted(reference, v)]
    stats = row_stats(rows, ref_ids, matrix.early)
    real = min(vocab.size, v)
    same = Aside("identical-rows", identical_rows, rows, stats.signature, real)
    lists = Aside("lists", _lists, stats) if all_tokens else None
    try:
        return _signals(matrix, stats, ref_ids, not_ordinary, real, (same, lists))
    finally:
        same.wait()
        if lists is not None:
            lists.wait()


def _signals(
    matrix: Matrix,
    stats: RowStats,
    ref_ids: npt.NDArray[np.int64],
    not_ordinary: npt.NDArray[np.int64],
    real: int,
    aside: tuple[Aside[list[list[int]]], Aside[tuple[list[float], list[float]]] | None],
) -> _Scanned:
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
    return _Scanned(report, stats, norm.score, mean.score, flags)


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


def scan(matrices: list[Matrix], vocab: Vocab, tokens: Tokens, *, all_tokens: bool) -> Undertrained:
    """Every signal over every matrix given (the head first, or the tied embedding alone), the
    candidates of all of them, and the groups' verdicts."""
    reference, not_ordinary = tokens.arrays()
    scanned = [
        scan_matrix(m, vocab, reference, not_ordinary, all_tokens=all_tokens) for m in matrices
    ]
    main = scanned[0]
    v = min(s.flags["norm"].shape[0] for s in scanned)
    real = min(vocab.size, v)
    ref_ids = reference[: np.searchsorted(reference, main.flags["norm"].shape[0])]
    is_ref = np.zeros(real, dtype=bool)
    is_ref[ref_ids[ref_ids < real]] = True
    order = _taking_turns(scanned, real, is_ref)
    candidates = [_candidate(i, vocab, scanned) for i in order]
    by_kind = tokens.reference.kinds.below(main.flags["norm"].shape[0]).counts()
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
        groups=[_group(kind, ids, scanned) for kind, ids in _within(tokens.groups, v)],
    )


def _taking_turns(scanned: list[_Scanned], real: int, is_ref: npt.NDArray[np.bool_]) -> list[int]:
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


def _ranked(s: _Scanned, signal: str, real: int, is_ref: npt.NDArray[np.bool_]) -> list[int]:
    """The real tokens one signal flags in one matrix, strongest first (ties by id)."""
    ids = np.flatnonzero(s.flags[signal][:real] & ~is_ref)
    if signal == "indicator":
        key = -s.stats.indicator[ids].astype(np.float64)
    elif signal == "norm":
        key = -np.abs(s.score[ids])
    else:
        key = s.ratio[ids]
    return [int(i) for i in ids[np.lexsort((ids, key))]]


def _figures(s: _Scanned, i: int) -> RowFigures:
    return RowFigures(
        indicator=float(s.stats.indicator[i]),
        norm=float(s.stats.norms[i]),
        norm_score=float(s.score[i]),
        mean_distance=float(s.ratio[i]),
        signals=[k for k in SIGNALS if s.flags[k][i]],
    )


def _candidate(i: int, vocab: Vocab, scanned: list[_Scanned]) -> Candidate:
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


def _within(groups: list[tuple[str, list[int]]], v: int) -> list[tuple[str, list[int]]]:
    """The groups' rows that every matrix has, groups left empty dropped."""
    kept = [(kind, [i for i in ids if i < v]) for kind, ids in groups]
    return [(kind, ids) for kind, ids in kept if ids]


def _group(kind: str, ids: list[int], scanned: list[_Scanned]) -> RowGroup:
    """A group of rows checked together, in every matrix, with a one-line verdict."""
    at = np.asarray(ids, dtype=np.int64)
    parts = [_group_matrix(s, at) for s in scanned]
    verdicts = {p.verdict for p in parts}
    verdict = (
        "untrained"
        if "untrained" in verdicts
        else "partly untrained"
        if "partly untrained" in verdicts
        else "ordinary"
    )
    first, last = min(ids), max(ids)
    return RowGroup(kind, first, last, len(ids), parts, verdict, group_line(kind, ids, parts))


def _group_matrix(s: _Scanned, at: npt.NDArray[np.int64]) -> GroupMatrix:
    by_signal = {k: int(s.flags[k][at].sum()) for k in SIGNALS}
    flagged = int(np.any([s.flags[k][at] for k in SIGNALS], axis=0).sum())
    verdict = (
        "untrained" if 2 * flagged > len(at) else "partly untrained" if flagged else "ordinary"
    )
    return GroupMatrix(
        matrix=s.report.matrix,
        norm_median=float(np.median(s.stats.norms[at])),
        ordinary_norm_median=s.report.ordinary_norm_median,
        flagged=flagged,
        by_signal={k: n for k, n in by_signal.items() if n},
        verdict=verdict,
    )


_MATRIX_NAMES = {"input": "the embedding", "output": "the head"}


def group_line(kind: str, ids: list[int], parts: list[GroupMatrix]) -> str:
    """'the 8 added tokens' rows (ids 62-69) look untrained: norm 0.0213 against 3.15 (8 of 8
    flagged: norm 8)', each matrix's figures given."""
    n = len(ids)
    if kind == "added_tokens":
        noun = "the added token's row" if n == 1 else f"the {n:,} added tokens' rows"
    else:
        noun = "the row past the tokenizer" if n == 1 else f"the {n:,} rows past the tokenizer"
    head = f"{noun} ({f'id {ids[0]}' if n == 1 else f'ids {min(ids)}-{max(ids)}'})"
    if len(parts) == 1:
        return f"{head} {_look(parts[0], n)}: {_detail(parts[0], n)}"
    if len({(p.verdict, p.flagged if p.verdict == "partly untrained" else 0) for p in parts}) == 1:
        details = ", ".join(f"{_detail(p, n)} in {_MATRIX_NAMES[p.matrix]}" for p in parts)
        return f"{head} {_look(parts[0], n)} in both matrices: {details}"
    details = "; ".join(
        f"in {_MATRIX_NAMES[p.matrix]} {_look(p, n, pronoun=True)} ({_detail(p, n, inner=True)})"
        for p in parts
    )
    return f"{head}: {details}"


def _look(p: GroupMatrix, n: int, *, pronoun: bool = False) -> str:
    """'look untrained', 'looks like the ordinary rows', 'they look ...', '3 of 8 look ...'."""
    if p.verdict == "partly untrained":
        return f"{p.flagged:,} of {n:,} look untrained"
    verb = "looks" if n == 1 else "look"
    if pronoun:
        verb = ("it " if n == 1 else "they ") + verb
    return f"{verb} {'untrained' if p.verdict == 'untrained' else 'like the ordinary rows'}"


def _detail(p: GroupMatrix, n: int, *, inner: bool = False) -> str:
    """'norm 0.02 against 3.15 (8 of 8 flagged: norm 8)'; `inner`: '..., 8 of 8 flagged: ...'."""
    against = "-" if p.ordinary_norm_median is None else f"{p.ordinary_norm_median:.3g}"
    flagged = (
        "none flagged"
        if not p.flagged
        else f"{p.flagged:,} of {n:,} flagged: "
        + ", ".join(f"{k} {count:,}" for k, count in p.by_signal.items())
    )
    norms = f"norm {p.norm_median:.3g} against {against}"
    return f"{norms}, {flagged}" if inner else f"{norms} ({flagged})"


def _lists(stats: RowStats) -> tuple[list[float], list[float]]:
    """Every row's indicator and norm as lists (`_listed`)."""
    return _listed(stats.indicator), _listed(stats.norms)


def _listed(values: npt.NDArray[np.float32]) -> list[float]:
    """Every row's value to 6 decimals (float32 holds about 7 digits; a 262k-row list prints in a
    fraction of the time full-length floats take)."""
    return list(np.round(values.astype(np.float64), 6).tolist())
