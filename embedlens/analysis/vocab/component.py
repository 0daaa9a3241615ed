"""The first principal component of a matrix's rows, on its own: the direction every row shares,
which the under-trained indicator removes (`signals`).

It comes from a sample of the rows (at most SAMPLE_ROWS, evenly spaced), read apart: on a thread
of its own (`begin_component`, an `Aside`), begun while the caller reads the tokenizer. A narrow
covariance is decomposed exactly; a wider one by Lanczos (`top_eigenvector`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from embedlens.analysis.vocab.sums import dot, matvec, norm, vecmat
from embedlens.model.matrix import Rows

SAMPLE_ROWS = 16384
EXACT_WIDTH = 256  # covariances up to this width are decomposed exactly (milliseconds)
LANCZOS_TOL = 1e-9
CHECK_EVERY = 8  # Lanczos steps between residual checks
T = TypeVar("T")
Found = tuple[npt.NDArray[np.float64], str, npt.NDArray[np.float64]]
"""A first principal component, how it was found, and the rows' mean (`component`)."""


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
    eigenvalue), and is exact after d steps. Its products are summed in a fixed order (`sums`),
    so the steps taken and the vector found do not depend on BLAS's threads."""
    d = a.shape[0]
    basis = np.zeros((d + 1, d))
    start = np.asarray(np.random.default_rng(0).standard_normal(d), dtype=np.float64)
    basis[0] = start / norm(start)
    alphas: list[float] = []
    betas: list[float] = []
    for k in range(d):
        w = matvec(a, basis[k])
        alphas.append(dot(w, basis[k]))
        for _ in range(2):  # twice is enough to keep the basis orthogonal in floating point
            w -= vecmat(matvec(basis[: k + 1], w), basis[: k + 1])
        beta = norm(w)
        last = k + 1 == d or beta == 0.0
        if (k + 1) % CHECK_EVERY == 0 or last:  # each check is an eigh of the tridiagonal
            theta, ritz = _top_ritz(alphas, betas)
            residual = beta * abs(float(ritz[-1])) / theta if theta > 0 else 0.0
            if residual <= tol or last:
                y = vecmat(ritz, basis[: k + 1])
                return y / norm(y), k + 1, residual
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
