"""The vocabulary against the matrices: sizes, padding and missing rows, where added tokens sit,
the rows known to be unused and what the scan is told of each row (`against_rows`, one call),
and the tokens the tokenizer never produces as themselves (`find_unreachable`).

A token is unreachable when decoding it and encoding the text again does not give it back: byte
fragments of a multi-byte character, SentencePiece byte pieces of bytes that have their own token,
merges that other merges always win over. All tokens go through the tokenizer in two batched calls.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from embedlens.analysis.vocab.fingerprint import Entries
from embedlens.analysis.vocab.kinds import TokenKinds
from embedlens.analysis.vocab.signals import ReferenceRows, Tokens
from embedlens.model.matrix import Table, stored_rows
from embedlens.model.tokenizer import Vocab
from embedlens.model.tokens import REPLACEMENT, SPACE, outside_byte_alphabet
from embedlens.reports.tokens import TokenRef
from embedlens.reports.vocab import Layout, Unreachable, UnreachableToken

if TYPE_CHECKING:
    from tokenizers import Tokenizer

BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
LISTED = 100  # unreachable tokens listed per kind (all are counted)
_NEVER_PRODUCED = frozenset({"single_byte", "shadowed", "unmerged", "byte_fallback"})


def added_ids(vocab: Vocab) -> list[int]:
    """Ids of the tokens added on top of the tokenizer's model (specials included), sorted."""
    return sorted(vocab.added)


@dataclass(frozen=True)
class AgainstRows:
    """The vocabulary against the matrices' rows: the layout, what in it makes the model
    misbehave, and what the vocabulary says of the rows (the scan's `Tokens`)."""

    layout: Layout
    problems: list[str]
    tokens: Tokens


def against_rows(
    vocab: Vocab, table: Table, unreachable: TokenKinds, named: list[int]
) -> AgainstRows:
    """The vocabulary against `table`'s rows, with every token it never produces
    (`unreachable`, each with its kind) and the ids of the entries named unused (`named`). The
    scan leaves out the ids past the rows each matrix has."""
    added = added_ids(vocab)
    layout = read_layout(vocab, table, added)
    reference = reference_rows(vocab.size, unreachable, table.rows, named)
    tokens = _tokens(vocab, added, reference, unreachable, table.rows)
    return AgainstRows(layout, layout_problems(layout), tokens)


def read_layout(vocab: Vocab, table: Table, added: list[int]) -> Layout:
    """Sizes, padding and missing rows, special tokens, and where the added tokens (`added`,
    `added_ids`) sit."""
    embedding = _embedding_entry(table)
    rows = stored_rows(table, embedding)
    placement, inserted = _placement(added, vocab.size)
    specials = sorted(vocab.special_ids | set(added))
    return Layout(
        tokenizer_size=vocab.size,
        embedding_tensor=embedding,
        embedding_rows=rows,
        head_tensor=table.name,
        head_rows=table.rows,
        width=table.width,
        tied=table.tied,
        padding_rows=max(0, min(table.rows, rows) - vocab.size),
        missing_rows=max(0, vocab.size - min(table.rows, rows)),
        special_tokens=[TokenRef(i, vocab.text(i)) for i in specials if i in vocab.special_ids],
        added_tokens=len(added),
        added_placement=placement,
        inserted=[TokenRef(i, vocab.text(i)) for i in inserted],
    )


def _tokens(
    vocab: Vocab, added: list[int], reference: ReferenceRows, unreachable: TokenKinds, rows: int
) -> Tokens:
    """The rows known unused, the tokens that are not ordinary, and the groups of rows added at
    the end: added tokens past the last ordinary id (not named unused), rows past the tokenizer."""
    taken = set(added)
    base = vocab.size
    while base > 0 and base - 1 in taken:
        base -= 1
    known = set(reference.kinds.ids[np.searchsorted(reference.kinds.ids, base) :].tolist())
    late = [i for i in range(base, vocab.size) if i not in known] if base else []
    groups = [("added_tokens", late), ("past_tokenizer", list(range(vocab.size, rows)))]
    return Tokens(reference, unreachable.ids, frozenset(taken | vocab.special_ids), groups)


def _embedding_entry(table: Table) -> str:
    if table.tied or table.which == "input":
        return table.name
    from embedlens.model.inventory import from_checkpoint

    inv = from_checkpoint(table.checkpoint, table.config)
    assert inv.embedding is not None
    return inv.embedding


def _placement(added: list[int], size: int) -> tuple[str, list[int]]:
    """Where the added tokens sit among the ordinary ones, and those with ordinary ids both sides."""
    if not added:
        return "none", []
    taken = set(added)
    low = next((i for i in range(size) if i not in taken), None)
    if low is None:
        return "start", []
    high = next(i for i in range(size - 1, -1, -1) if i not in taken)
    inside = [i for i in added if low < i < high]
    if inside:
        return "inside", inside
    at_start = any(i < low for i in added)
    at_end = any(i > high for i in added)
    return ("start and end" if at_start and at_end else "start" if at_start else "end"), []


def layout_problems(layout: Layout) -> list[str]:
    """What in the layout makes the model misbehave."""
    problems: list[str] = []
    if layout.missing_rows:
        problems.append(
            f"{layout.missing_rows:,} tokens have no row: the tokenizer has "
            f"{layout.tokenizer_size:,} tokens, the matrices {min(layout.embedding_rows, layout.head_rows):,} "
            "rows; looking them up fails"
        )
    if layout.embedding_rows != layout.head_rows:
        problems.append(
            f"the embedding has {layout.embedding_rows:,} rows but the head {layout.head_rows:,}"
        )
    if layout.inserted:
        first = layout.inserted[0].id
        problems.append(
            f"{len(layout.inserted)} added tokens sit inside the ordinary range (from id {first}): "
            f"if they were inserted after training, every id after them moved and looks up its "
            "neighbour's row (check with --check-fit, or --against the original tokenizer)"
        )
    return problems


# --- tokens never produced -----------------------------------------------------------------------


def find_unreachable(
    vocab: Vocab, entries: Entries, merged: frozenset[str] | None = None
) -> tuple[Unreachable, dict[int, str]]:
    """Ordinary tokens that decoding and encoding again does not give back: the report (the
    first LISTED of each kind listed) and every such id with its kind. `entries` holds every
    id's entry and bytes and the tokenizer they were read with (`read_entries`); `merged`, when
    known, every piece a byte-level BPE merge builds (byte_level_merge_results)."""
    skip = set(added_ids(vocab)) | vocab.special_ids
    ids = [i for i in range(vocab.size) if i not in skip]
    bl, tok, pieces, raw = entries.byte_level, entries.tokenizer, entries.pieces, entries.raw
    found: dict[int, list[int] | None] = {}
    unmerged: set[int] = set()
    if bl:  # a token whose bytes are not UTF-8 decodes to U+FFFD: it never comes back
        broken = _not_utf8(raw, ids)
        found.update((i, None) for i in sorted(broken))
        whole = [i for i in ids if i not in broken] if broken else ids
        if merged is not None:  # BPE builds a piece of two or more symbols only by a merge
            unmerged = _unmerged(pieces, whole, merged)
            found.update((i, None) for i in sorted(unmerged))
            whole = [i for i in whole if i not in unmerged]
        found.update(_round_trip(vocab, tok, whole, [raw[i].decode("utf-8") for i in whole]))
    else:
        texts = tok.decode_batch([[i] for i in ids], skip_special_tokens=False)
        found.update(_round_trip(vocab, tok, ids, texts))
    kinds = {
        i: "unmerged" if i in unmerged else _kind(pieces[i] or "", raw[i]) for i in sorted(found)
    }
    return _listed(vocab, tok, found, kinds), kinds


def _unmerged(pieces: list[str | None], ids: list[int], merged: frozenset[str]) -> set[int]:
    """The ids whose piece has two or more byte symbols (spelled in the byte alphabet) that no
    merge builds."""
    maybe = [i for i in ids if (p := pieces[i]) is not None and len(p) > 1 and p not in merged]
    outside = outside_byte_alphabet([pieces[i] or "" for i in maybe])
    return {i for k, i in enumerate(maybe) if k not in outside}


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _not_utf8(raw: list[bytes], ids: list[int]) -> set[int]:
    """The ids among `ids` whose bytes are not UTF-8 (one loop, no call per id)."""
    broken: set[int] = set()
    for i in ids:
        try:
            raw[i].decode("utf-8")
        except UnicodeDecodeError:
            broken.add(i)
    return broken


def _encode(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    batch = getattr(tok, "encode_batch_fast", tok.encode_batch)
    return [e.ids for e in batch(texts, add_special_tokens=False)]


def _round_trip(
    vocab: Vocab, tok: Tokenizer, ids: list[int], texts: list[str]
) -> dict[int, list[int] | None]:
    """The ids among `ids` whose text (`texts`) does not encode back to them (through `tok`, the
    vocabulary's tokenizer), with what it gives."""
    metaspace = _metaspace(tok)
    found: dict[int, list[int] | None] = {}
    for i, text, got in zip(ids, texts, _encode(tok, texts), strict=True):
        if len(got) == 1 and got[0] == i:
            continue
        piece = vocab.piece(i) or ""
        if metaspace and not piece.startswith(SPACE) and REPLACEMENT not in text:
            # A piece without '▁' never starts a word: encoding it alone adds the '▁'. Ask the
            # model's merges directly whether they build it.
            got = [t.id for t in tok.model.tokenize(piece)]
            if got == [i]:
                continue
        found[i] = got
    return found


def _listed(
    vocab: Vocab, tok: Tokenizer, found: dict[int, list[int] | None], kinds: dict[int, str]
) -> Unreachable:
    """The report: counts by kind, and the first LISTED of each kind with what they encode as."""
    from collections import Counter

    by_kind = Counter(kinds[i] for i in found)
    firsts: dict[str, list[int]] = {kind: [] for kind in by_kind}
    open_kinds = len(firsts)
    for i in sorted(found):  # the first LISTED ids of each kind, in one walk
        ids = firsts[kinds[i]]
        if len(ids) < LISTED:
            ids.append(i)
            open_kinds -= len(ids) == min(LISTED, by_kind[kinds[i]])
            if not open_kinds:
                break
    chosen = sorted(i for ids in firsts.values() for i in ids)
    unknown = [i for i in chosen if found[i] is None]
    if unknown:  # fragments and unmerged pieces: what their decoded text encodes as
        texts = tok.decode_batch([[i] for i in unknown], skip_special_tokens=False)
        found.update(zip(unknown, _encode(tok, texts), strict=True))
    listed = [UnreachableToken(i, vocab.text(i), kinds[i], list(found[i] or [])) for i in chosen]
    return Unreachable(len(found), dict(sorted(by_kind.items())), listed)


def _metaspace(tok: Tokenizer) -> bool:
    pre = tok.pre_tokenizer
    return pre is not None and ("Metaspace" in type(pre).__name__ or SPACE in str(pre))


def _kind(piece: str, raw: bytes) -> str:
    """Why a token never comes back: a byte piece, a fragment of a character, or merges that
    other merges win over."""
    if piece.startswith("<0x") and BYTE_PIECE.match(piece):
        return "byte_fallback" if int(piece[3:5], 16) < 0x80 else "single_byte"
    if not _utf8(raw):
        return "single_byte" if len(raw) == 1 else "partial_utf8"
    return "shadowed"


def reference_rows(
    size: int, unreachable: TokenKinds, rows: int, named: list[int]
) -> ReferenceRows:
    """Rows known unused: padding (rows from the tokenizer's `size` on), tokens never produced
    as themselves, tokens named unused (`named`, facts.named_unused); a row's kind is the last
    of these that names it."""
    padding = TokenKinds.one(range(size, rows), "padding")  # after every token's id
    unused = TokenKinds.one(sorted({i for i in named if i < rows}), "named_unused")
    return ReferenceRows(unreachable.only(_NEVER_PRODUCED).then(padding, unused))
