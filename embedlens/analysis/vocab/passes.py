"""The passes over a matrix: read block by block (a float32 piece at a time, never the whole
matrix), by one thread per core, each over its own share of the rows (numpy's products release
the interpreter's lock).

Once for the reference rows' mean when they are too many to take one by one (`reference_mean`),
once for every row's figures (`row_stats`: indicator, norm, signature, distance to the mean);
rows exactly equal to each other are found from the signatures (`identical_rows`). Everything
else is a vector of V or a [d, d] matrix.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from embedlens.analysis.vocab.component import SAMPLE_ROWS, Aside, Found, component
from embedlens.analysis.vocab.sums import dot, dot_rows, norm
from embedlens.model.matrix import Rows

MAX_WORKERS = 8
SHARE_ROWS = 16384  # rows a thread takes at least (fewer go on one thread)
PIECE_VALUES = 1 << 19
"""Float32 values (2 MiB) in a piece of a pass's block, at least: a larger block (the 16 MiB of a
type read through gguf's formulas) is read and multiplied a piece at a time, while it is in
cache. Pieces this large keep the block's figures: OpenBLAS's small-matrix kernels, which it
takes below 10^6 multiply-adds on AVX-512, sum in another order, and a piece's product by three
vectors is above that."""


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
    u); the distance to the mean m from |x - m|^2 = |x|^2 - 2 x.m + |m|^2, in float64.

    Every product of a row is summed in an order of its own (`dot_rows`), never by BLAS: BLAS's
    matrix-vector kernels sum in an order that depends on its threads and on where the arrays
    lie, and a row's figure moved in its last bit with the process's history."""
    v, d = rows.shape
    ref = reference_mean(rows, reference)  # while `early` is still being found
    u, how, centre = early.result() if early is not None else component(rows)
    ref = ref - dot(ref, u) * u
    ref_norm = norm(ref)
    probe = np.random.default_rng(0).standard_normal(d)
    direction = ref / ref_norm if ref_norm else ref
    # One vector a row of `vectors`: u, the direction, the probe and the mean.
    vectors = np.stack([u, direction, probe, centre]).astype(np.float32)
    products = np.empty((4, v), dtype=np.float32)
    squares = np.empty(v, dtype=np.float32)
    step = rows.pass_rows

    def share(own: Rows, first: int, last: int) -> None:
        for start in range(first, last, step):
            for a, b in pieces(start, min(last, start + step), d):
                block = own.block(a, b)
                dot_rows(block, vectors, products[:, a:b])
                np.einsum("ij,ij->i", block, block, out=squares[a:b])

    in_shares(rows, step, share)
    norms = np.sqrt(squares)
    proj, dots, to_mean = products[0], products[1], products[3]
    residual = np.sqrt(np.maximum(squares - proj * proj, 0.0))
    if ref_norm == 0.0:
        values = np.full(v, np.nan, dtype=np.float32)
    else:
        with np.errstate(divide="ignore", invalid="ignore"):
            values = np.where(residual > 1e-12 * (norms + 1e-30), dots / residual, np.nan)
    m = vectors[3].astype(np.float64)
    apart = squares.astype(np.float64) - 2.0 * to_mean + dot(m, m)
    distance = np.sqrt(np.maximum(apart, 0.0))
    return RowStats(values.astype(np.float32), norms, products[2].copy(), how, distance)


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
