"""Under-trained tokens, after Land and Bartolo, "Fishing for Magikarp" (2024, arXiv 2405.05417).

Rows that training never moved share a direction: the softmax pushes every unused row of the head
the same way. The indicator of a token is the cosine of its row, with the matrix's first principal
component removed (a direction all rows share), to the mean of rows known to be unused: padding
rows, tokens the tokenizer never produces as themselves, tokens the vocabulary names unused.
Tokens at or above the reference rows' own 99th percentile are candidates. Rows that are exactly
equal to each other are listed too: training would have moved them apart.

The matrix is read once, block by block (a float32 block at a time, never the whole matrix), by
one thread per core, each over its own share of the rows (numpy's products release the
interpreter's lock); everything else is a vector of V or a [d, d] matrix.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from embedlens.model.matrix import Rows, Table
from embedlens.model.tokenizer import Vocab
from embedlens.reports.vocab import Candidate, Undertrained

PERCENTILE = 99.0
SAMPLE_ROWS = 16384
EXACT_WIDTH = 256  # covariances up to this width are decomposed exactly (milliseconds)
LANCZOS_TOL = 1e-9
CHECK_EVERY = 8  # Lanczos steps between residual checks
THRESHOLD_RULE = "at or above the 99th percentile of the reference rows' indicator"
MAX_WORKERS = 8
SHARE_ROWS = 16384  # rows a thread takes at least (fewer go on one thread)


@dataclass(frozen=True)
class ReferenceRows:
    """Rows known unused, with why: 'padding', 'single_byte', 'shadowed', 'named_unused', ..."""

    kinds: dict[int, str]

    @property
    def ids(self) -> list[int]:
        """The rows, sorted."""
        return sorted(self.kinds)


@dataclass(frozen=True)
class RowStats:
    """Per-row figures from one pass over the matrix (float32 vectors of V)."""

    indicator: npt.NDArray[np.float32]
    norms: npt.NDArray[np.float32]
    signature: npt.NDArray[np.float32]
    """Each row's product with a fixed random vector: equal rows have equal signatures."""
    component: str
    """How the first principal component was found."""


def first_component(rows: Rows) -> tuple[npt.NDArray[np.float64], str]:
    """The unit first principal component of the rows (of the centred covariance), and how it
    was found.

    Estimated from at most SAMPLE_ROWS evenly spaced rows: the direction all rows share is
    dominant, and the full [d, V] x [V, d] product would cost seconds on a large vocabulary.
    A narrow covariance is decomposed exactly (eigh); a wider one by Lanczos (top_eigenvector),
    which needs a few dozen [d, d] products where eigh costs seconds at d = 896."""
    v = rows.shape[0]
    sample = rows.take(list(range(0, v, max(1, -(-v // SAMPLE_ROWS)))))
    mean = sample.mean(axis=0, dtype=np.float64)
    gram = (sample.T @ sample).astype(np.float64) / sample.shape[0]
    covariance = gram - np.outer(mean, mean)
    of = f"{sample.shape[0]:,} of {v:,} rows" if sample.shape[0] < v else f"all {v:,} rows"
    if covariance.shape[0] <= EXACT_WIDTH:
        _, vectors = np.linalg.eigh(covariance)
        return np.asarray(vectors[:, -1], dtype=np.float64), f"eigendecomposition of {of}"
    u, steps, residual = top_eigenvector(covariance)
    how = f"Lanczos on the covariance of {of}, {steps} steps, relative residual {residual:.1e}"
    return u, how


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

    def run(k: int, own: Rows) -> None:
        try:
            work(own, bounds[k], bounds[k + 1])
        except BaseException as e:  # raised by the caller's thread below
            errors.append(e)

    threads = [
        threading.Thread(target=run, args=(k, rows.twin()), daemon=True) for k in range(1, n)
    ]
    for t in threads:
        t.start()
    run(0, rows)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def reference_mean(rows: Rows, reference: list[int]) -> npt.NDArray[np.float64]:
    """The mean of the reference rows: taken one by one when they are few, else summed block by
    block (a vocabulary whose every token is a reference row is not copied whole), the blocks'
    sums added in order whatever the threads (the same figure on any machine)."""
    v, d = rows.shape
    if not reference:
        return np.zeros(d)
    if len(reference) <= SAMPLE_ROWS:
        return np.asarray(rows.take(reference).mean(axis=0, dtype=np.float64))
    weights = np.zeros(v, dtype=np.float32)
    weights[reference] = 1.0
    step = rows.pass_rows
    sums = np.empty((-(-v // step), d), dtype=np.float32)

    def share(own: Rows, first: int, last: int) -> None:
        for start in range(first, last, step):
            stop = min(last, start + step)
            block = own.block(start, stop)  # no BLAS call: its threads would spin beside ours
            np.einsum("i,ij->j", weights[start:stop], block, out=sums[start // step])

    in_shares(rows, step, share)
    total = np.zeros(d)
    for block_sum in sums:
        total += block_sum
    return total / len(reference)


def row_stats(rows: Rows, reference: list[int]) -> RowStats:
    """Indicator, norm and signature of every row, reading the matrix once, block by block:
    cosine to the reference rows' mean with the first principal component u removed, from
    |x - (x.u)u|^2 = |x|^2 - (x.u)^2 and (x - (x.u)u).r = x.r (r is orthogonal to u)."""
    v, d = rows.shape
    u, how = first_component(rows)
    ref = reference_mean(rows, reference)
    ref = ref - float(ref @ u) * u
    ref_norm = float(np.linalg.norm(ref))
    probe = np.random.default_rng(0).standard_normal(d)
    weights = np.stack([u, ref / ref_norm if ref_norm else ref, probe], axis=1).astype(np.float32)
    products = np.empty((v, 3), dtype=np.float32)
    squares = np.empty(v, dtype=np.float32)
    step = rows.pass_rows

    def share(own: Rows, first: int, last: int) -> None:
        for start in range(first, last, step):
            stop = min(last, start + step)
            block = own.block(start, stop)
            np.matmul(block, weights, out=products[start:stop])
            np.einsum("ij,ij->i", block, block, out=squares[start:stop])

    in_shares(rows, step, share)
    norms = np.sqrt(squares)
    proj, dots = products[:, 0], products[:, 1]
    residual = np.sqrt(np.maximum(squares - proj * proj, 0.0))
    if ref_norm == 0.0:
        values = np.full(v, np.nan, dtype=np.float32)
    else:
        with np.errstate(divide="ignore", invalid="ignore"):
            values = np.where(residual > 1e-12 * (norms + 1e-30), dots / residual, np.nan)
    return RowStats(values.astype(np.float32), norms, products[:, 2].copy(), how)


def identical_rows(rows: Rows, signature: npt.NDArray[np.float32], limit: int) -> list[list[int]]:
    """Groups of real tokens' rows (below `limit`) that are exactly equal, largest first: rows
    with equal signatures, compared in full."""
    order = np.argsort(signature[:limit], kind="stable")
    sig = signature[order]
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


def scan(
    rows: Rows, table: Table, vocab: Vocab, reference: ReferenceRows, *, all_tokens: bool
) -> Undertrained:
    """The indicator over every row, candidates best first, and how the first principal
    component was found."""
    v = rows.shape[0]
    ref_ids = [i for i in reference.ids if i < v]
    stats = row_stats(rows, ref_ids)
    values, norms = stats.indicator, stats.norms
    real = min(vocab.size, v)
    threshold: float | None = None
    ref_values = values[ref_ids] if ref_ids else np.empty(0, np.float32)
    ref_values = ref_values[np.isfinite(ref_values)]
    if ref_values.size:
        threshold = float(np.percentile(ref_values, PERCENTILE))
    is_ref = np.zeros(v, dtype=bool)
    is_ref[ref_ids] = True
    candidates: list[Candidate] = []
    if threshold is not None:
        above = np.flatnonzero((values[:real] >= threshold) & ~is_ref[:real])
        above = above[np.lexsort((above, -values[above].astype(np.float64)))]
        candidates = [
            Candidate(
                int(i),
                vocab.text(int(i)),
                float(values[i]),
                float(norms[i]),
                int(i) in vocab.special_ids,
                None,
                "candidate",
            )
            for i in above
        ]
    by_kind: dict[str, int] = {}
    for i in ref_ids:
        by_kind[reference.kinds[i]] = by_kind.get(reference.kinds[i], 0) + 1
    counts = {
        "reference": len(ref_ids),
        "candidate": len(candidates),
        "ok": real - len(candidates) - int(is_ref[:real].sum()),
    }
    scanned = Undertrained(
        matrix="input" if table.tied else "output",
        tensor=table.name,
        reference_count=len(ref_ids),
        reference_by_kind=dict(sorted(by_kind.items())),
        threshold=threshold,
        threshold_rule=THRESHOLD_RULE if threshold is not None else "no reference rows",
        component=stats.component,
        counts=counts,
        norm_median=float(np.median(norms[:real])) if real else 0.0,
        reference_norm_median=float(np.median(norms[ref_ids])) if ref_ids else None,
        identical_rows=identical_rows(rows, stats.signature, real),
        candidates=candidates,
        verified=0,
        indicators=_listed(values) if all_tokens else None,
        norms=_listed(norms) if all_tokens else None,
    )
    return scanned


def _listed(values: npt.NDArray[np.float32]) -> list[float]:
    """Every row's value to 6 decimals (float32 holds about 7 digits; a 262k-row list prints in a
    fraction of the time full-length floats take)."""
    return list(np.round(values.astype(np.float64), 6).tolist())
