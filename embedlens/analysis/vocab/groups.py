"""Groups of rows added at the end of the table (added tokens past the last ordinary id, rows
past the tokenizer): what the signals say of each group, and the sentence that says it."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from embedlens.analysis.vocab.signals import SIGNALS, Scanned
from embedlens.reports.vocab import (
    GroupMatrix,
    RowGroup,
)


def row_groups(
    groups: list[tuple[str, list[int]]], v: int, scanned: list[Scanned]
) -> list[RowGroup]:
    """Each group's rows that every matrix has (below `v`), checked together in every matrix
    (`group`); groups left empty dropped."""
    return [group(kind, ids, scanned) for kind, ids in within(groups, v)]


def within(groups: list[tuple[str, list[int]]], v: int) -> list[tuple[str, list[int]]]:
    """The groups' rows that every matrix has, groups left empty dropped."""
    kept = [(kind, [i for i in ids if i < v]) for kind, ids in groups]
    return [(kind, ids) for kind, ids in kept if ids]


def group(kind: str, ids: list[int], scanned: list[Scanned]) -> RowGroup:
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


def _group_matrix(s: Scanned, at: npt.NDArray[np.int64]) -> GroupMatrix:
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
