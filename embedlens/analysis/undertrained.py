"""Under-trained tokens, after Land and Bartolo, "Fishing for Magikarp" (2024, arXiv 2405.05417).

Rows that training never moved share a direction: the softmax pushes every unused row of the head
the same way. The indicator of a token is the cosine of its row, with the matrix's first principal
component removed (a direction all rows share), to the mean of rows known to be unused: padding
rows, tokens the tokenizer never produces as themselves, tokens the vocabulary names unused.
Tokens at or above the reference rows' own 99th percentile are candidates. Rows that are exactly
equal to each other are listed too: training would have moved them apart.

One float32 copy of the matrix is held; everything else is a vector or a [d, d] matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from embedlens.model.matrix import Rows, Table
from embedlens.model.tokenizer import Vocab
from embedlens.reports.vocab import Candidate, Undertrained

PERCENTILE = 99.0
SAMPLE_ROWS = 16384
THRESHOLD_RULE = "at or above the 99th percentile of the reference rows' indicator"


@dataclass(frozen=True)
class ReferenceRows:
    """Rows known unused, with why: 'padding', 'single_byte', 'shadowed', 'named_unused', ..."""

    kinds: dict[int, str]

    @property
    def ids(self) -> list[int]:
        """The rows, sorted."""
        return sorted(self.kinds)


def read_matrix(rows: Rows) -> npt.NDArray[np.float32]:
    """The whole matrix as float32, one block at a time into a single array."""
    v, d = rows.shape
    out = np.empty((v, d), dtype=np.float32)
    for start in range(0, v, rows.block_rows):
        stop = min(v, start + rows.block_rows)
        out[start:stop] = rows.block(start, stop)
    return out


def first_component(matrix: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    """The unit first principal component of the rows (of the centred covariance).

    Estimated from at most SAMPLE_ROWS evenly spaced rows: the direction all rows share is
    dominant, and the full [V, d] x [d, V] product would cost seconds on a large vocabulary.
    """
    v = matrix.shape[0]
    sample = matrix[:: max(1, -(-v // SAMPLE_ROWS))]
    mean = sample.mean(axis=0, dtype=np.float64)
    gram = (sample.T @ sample).astype(np.float64) / sample.shape[0]
    _, vectors = np.linalg.eigh(gram - np.outer(mean, mean))
    return np.asarray(vectors[:, -1], dtype=np.float64)


def indicator(
    matrix: npt.NDArray[np.float32], reference: list[int]
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """(indicator, norm) of every row: cosine to the reference rows' mean, first PC removed."""
    u = first_component(matrix).astype(np.float32)
    norms = np.sqrt(np.einsum("ij,ij->i", matrix, matrix))
    proj = matrix @ u
    ref = matrix[reference].mean(axis=0) if reference else np.zeros(matrix.shape[1], np.float32)
    ref = ref - float(ref @ u) * u
    ref_norm = float(np.linalg.norm(ref))
    if ref_norm == 0.0:
        return np.full(matrix.shape[0], np.nan, dtype=np.float32), norms
    # |x - (x.u)u|^2 = |x|^2 - (x.u)^2 and (x - (x.u)u).r = x.r since r is orthogonal to u.
    residual = np.sqrt(np.maximum(norms * norms - proj * proj, 0.0))
    dots = matrix @ (ref / ref_norm)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(residual > 1e-12 * (norms + 1e-30), dots / residual, np.nan)
    return out.astype(np.float32), norms


def identical_rows(matrix: npt.NDArray[np.float32], limit: int) -> list[list[int]]:
    """Groups of real tokens' rows (below `limit`) that are exactly equal, largest first."""
    real = matrix[:limit]
    rng = np.random.default_rng(0)
    sig = real @ rng.standard_normal(real.shape[1], dtype=np.float32)
    order = np.argsort(sig, kind="stable")
    same = np.flatnonzero(sig[order][1:] == sig[order][:-1])
    groups: dict[int, list[int]] = {}
    for k in same:
        a, b = int(order[k]), int(order[k + 1])
        if np.array_equal(real[a], real[b]):
            head = next((h for h, g in groups.items() if a in g), a)
            groups.setdefault(head, [a])
            if b not in groups[head]:
                groups[head].append(b)
    return sorted((sorted(g) for g in groups.values()), key=lambda g: (-len(g), g[0]))


def scan(
    rows: Rows, table: Table, vocab: Vocab, reference: ReferenceRows, *, all_tokens: bool
) -> Undertrained:
    """The indicator over every row; candidates best first."""
    matrix = read_matrix(rows)
    ref_ids = [i for i in reference.ids if i < matrix.shape[0]]
    values, norms = indicator(matrix, ref_ids)
    real = min(vocab.size, matrix.shape[0])
    threshold: float | None = None
    ref_values = values[ref_ids] if ref_ids else np.empty(0, np.float32)
    ref_values = ref_values[np.isfinite(ref_values)]
    if ref_values.size:
        threshold = float(np.percentile(ref_values, PERCENTILE))
    is_ref = np.zeros(matrix.shape[0], dtype=bool)
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
    return Undertrained(
        matrix="input" if table.tied else "output",
        tensor=table.name,
        reference_count=len(ref_ids),
        reference_by_kind=dict(sorted(by_kind.items())),
        threshold=threshold,
        threshold_rule=THRESHOLD_RULE if threshold is not None else "no reference rows",
        counts=counts,
        norm_median=float(np.median(norms[:real])) if real else 0.0,
        reference_norm_median=float(np.median(norms[ref_ids])) if ref_ids else None,
        identical_rows=identical_rows(matrix, real),
        candidates=candidates,
        verified=0,
        indicators=[float(x) for x in values] if all_tokens else None,
        norms=[float(x) for x in norms] if all_tokens else None,
    )
