"""Two vocabularies id by id: tokens added, removed, renamed, and blocks of ids shifted."""

from __future__ import annotations

from dataclasses import dataclass

from embedlens.analysis.vocab.fingerprint import fingerprint as sha
from embedlens.analysis.vocab.fingerprint import read_entries
from embedlens.model.tokenizer import Vocab
from embedlens.reports.tokens import TokenRef
from embedlens.reports.vocab import Fingerprint, Renamed, Shift, VocabDiff

EXAMPLES = 5
BLOCK = 8
"""A block of ids shifted together counts as one change from this many tokens on."""
RELATED = 0.5
"""Two vocabularies are related when at least this share of the tokens both hold sit at the
same id or in blocks shifted together; below it most ids differ one by one: unrelated."""


def shifts(moved: list[tuple[int, int]]) -> list[Shift]:
    """Runs of consecutive ids (in the first vocabulary) that moved by the same amount."""
    out: list[Shift] = []
    for i, delta in moved:
        last = out[-1] if out else None
        if last is not None and last.by == delta and last.stop == i - 1:
            out[-1] = Shift(last.start, i, delta, last.count + 1)
        else:
            out.append(Shift(i, i, delta, 1))
    return sorted(out, key=lambda s: (-s.count, s.start))


@dataclass(frozen=True)
class _Counts:
    same: int
    moved: int
    added: int
    removed: int


def _unrelated(name: str, n: _Counts) -> str:
    common = n.same + n.moved
    return (
        f"'{name}' is an unrelated vocabulary: of the {common:,} tokens both hold, {n.same:,} "
        f"sit at the same id and {n.moved:,} elsewhere, not in blocks; {n.removed:,} tokens "
        f"here are not in it, {n.added:,} of its are not here"
    )


def _summary(
    name: str, blocks: list[Shift], added: list[int], n: _Counts, *, identical: bool
) -> list[str]:
    """What changed between two related vocabularies: the largest shifted blocks, or counts."""
    summary: list[str] = []
    for s in blocks[:3]:
        if s.count < 2:
            continue
        gap = [j for j in added if s.start <= j < s.start + s.by] if s.by > 0 else []
        text = f"ids {s.start:,}-{s.stop:,} moved by {s.by:+,} in '{name}'"
        if gap and len(gap) == s.by:
            text += f" after {len(gap)} tokens were inserted at {s.start:,}"
        summary.append(text)
    if added and not summary:
        summary.append(f"'{name}' has {len(added):,} tokens this vocabulary lacks")
    if n.removed and not blocks:
        summary.append(f"{n.removed:,} tokens of this vocabulary are not in '{name}'")
    if not identical and not summary:
        summary.append(f"'{name}' differs from this vocabulary in its special tokens")
    return summary


def compare(mine: Vocab, other: Vocab, name: str, *, fingerprint: Fingerprint) -> VocabDiff:
    """Compare `mine` (the model's) with `other`, id by id. When most tokens both hold moved one
    by one rather than in blocks, the two are unrelated: counts are given, not the shifts."""
    a, b = read_entries(mine).raw, read_entries(other).raw
    where_b: dict[bytes, int] = {}
    for j, t in enumerate(b):
        where_b.setdefault(t, j)
    where_a: dict[bytes, int] = {}
    for i, t in enumerate(a):
        where_a.setdefault(t, i)
    same = sum(1 for i in range(min(len(a), len(b))) if a[i] == b[i])
    moved = [(i, where_b[t] - i) for i, t in enumerate(a) if t in where_b and where_b[t] != i]
    removed = [i for i, t in enumerate(a) if t not in where_b]
    added = [j for j, t in enumerate(b) if t not in where_a]
    renamed = [i for i in removed if i < len(b) and b[i] not in where_a]
    blocks = shifts(moved)
    other_sha = sha(other, b)
    identical = other_sha == fingerprint.sha256
    common = same + len(moved)
    kept = same + sum(s.count for s in blocks if s.count >= BLOCK)
    unrelated = bool(a) and bool(b) and kept < RELATED * max(common, 1)
    counts = _Counts(same, len(moved), len(added), len(removed))
    if unrelated:
        blocks = []
        summary = [_unrelated(name, counts)]
    else:
        summary = _summary(name, blocks, added, counts, identical=identical)
    return VocabDiff(
        other=name,
        other_size=other.size,
        other_fingerprint=other_sha,
        identical=identical,
        compatible=not moved and not removed and all(j >= len(a) for j in added),
        unrelated=unrelated,
        same_ids=same,
        added=len(added),
        removed=len(removed),
        renamed=len(renamed),
        shifted=len(moved),
        shifts=blocks,
        added_examples=[TokenRef(j, other.text(j)) for j in added[:EXAMPLES]],
        removed_examples=[TokenRef(i, mine.text(i)) for i in removed[:EXAMPLES]],
        renamed_examples=[Renamed(i, mine.text(i), other.text(i)) for i in renamed[:EXAMPLES]],
        summary=summary,
    )
