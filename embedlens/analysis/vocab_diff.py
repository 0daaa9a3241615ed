"""Two vocabularies id by id: tokens added, removed, renamed, and blocks of ids shifted."""

from __future__ import annotations

from embedlens.analysis.vocab_fingerprint import entries
from embedlens.analysis.vocab_fingerprint import fingerprint as sha
from embedlens.model.tokenizer import Vocab
from embedlens.reports.tokens import TokenRef
from embedlens.reports.vocab import Fingerprint, Renamed, Shift, VocabDiff

EXAMPLES = 5


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


def compare(mine: Vocab, other: Vocab, name: str, *, fingerprint: Fingerprint) -> VocabDiff:
    """Compare `mine` (the model's) with `other`, id by id."""
    a, b = entries(mine), entries(other)
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
    if removed and not blocks:
        summary.append(f"{len(removed):,} tokens of this vocabulary are not in '{name}'")
    if not identical and not summary:
        summary.append(f"'{name}' differs from this vocabulary in its special tokens")
    return VocabDiff(
        other=name,
        other_size=other.size,
        other_fingerprint=other_sha,
        identical=identical,
        compatible=not moved and not removed and all(j >= len(a) for j in added),
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
