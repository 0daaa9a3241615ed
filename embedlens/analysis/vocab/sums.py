"""Sums of products in an order of their own: the scan's dot products, never through BLAS.

BLAS's level-1 and level-2 kernels (a dot, a matrix by a vector) split their sums by thread and
by where the arrays lie in memory, so a figure could move in its last bit with the threads BLAS
runs on or with what ran before in the process (other allocations, other commands). numpy's
einsum, without its `optimize`, loops over the indices itself, in the same order every time:
the same bytes for the same input, whatever the process did before.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

Vector = npt.NDArray[Any]
Float64 = npt.NDArray[np.float64]


def dot(a: Vector, b: Vector) -> float:
    """a . b, summed in a fixed order."""
    return float(np.einsum("i,i->", a, b))


def norm(a: Vector) -> float:
    """|a|, from a . a summed in a fixed order."""
    return math.sqrt(dot(a, a))


def matvec(a: Float64, x: Float64) -> Float64:
    """a x (a: [n, d], x: [d]), each row's sum in a fixed order."""
    return np.asarray(np.einsum("ij,j->i", a, x))


def vecmat(x: Float64, a: Float64) -> Float64:
    """x a (x: [n], a: [n, d]): the rows of a weighted by x and added, in a fixed order."""
    return np.asarray(np.einsum("i,ij->j", x, a))


def dot_rows(
    block: npt.NDArray[np.float32], vectors: npt.NDArray[np.float32], out: npt.NDArray[np.float32]
) -> None:
    """out[k] = block . vectors[k] for each row of the block (block: [n, d], vectors: [m, d],
    out: [m, n]), each a row's sum in a fixed order: one pass over the block a vector."""
    for k in range(vectors.shape[0]):
        np.einsum("ij,j->i", block, vectors[k], out=out[k])
