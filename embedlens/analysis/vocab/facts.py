"""What `vocab` reads from a tokenizer alone, and for a GGUF, kept beside its built tokenizer.

The tokens the tokenizer never produces, the vocabulary's fingerprint, the entries named unused,
and every id's text with the added and special ids depend on the tokenizer only; finding the
unreachable tokens decodes and encodes every token. For a GGUF file they are kept in the
tokenizer cache (`gguf_cache`) under the tokenizer's key and this module's FORMAT, so a later
`vocab` on a file with the same tokenizer metadata reads them back instead of building the
tokenizer (which is then built only if something else asks for it: --against, --verify,
--check-fit). A missing or damaged entry means they are found again.
"""

from __future__ import annotations

import json
import re
import sys
from array import array
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np

from embedlens.analysis.vocab.fingerprint import fingerprint, read_entries
from embedlens.analysis.vocab.kinds import TokenKinds
from embedlens.analysis.vocab.layout import find_unreachable
from embedlens.io.gguf import GGUFHeader
from embedlens.io.source import ModelSource
from embedlens.model import gguf_cache
from embedlens.model.gguf_vocab import byte_level_merge_results
from embedlens.model.tokenizer import (
    GGUF_ORIGIN,
    PackedTexts,
    Vocab,
    load_vocab,
    vocab_from_gguf,
)
from embedlens.reports.vocab import Unreachable, UnreachableToken

FORMAT = 1
"""Raise when what is kept, or how it is found, changes."""

# Entries a vocabulary itself names as unused or reserved: <unused12>, <|reserved_special_token_5|>,
# [unused7], <extra_id_3>.
_UNUSED_NAME = re.compile(r"^[<\[]\|?(unused|reserved|extra_id)[\w-]*\|?[>\]]$", re.IGNORECASE)


@dataclass(frozen=True)
class VocabFacts:
    """A tokenizer's own facts: its fingerprint, the tokens it never produces (the report and
    every such id's kind) and the ids of entries named unused."""

    fingerprint: str
    unreachable: Unreachable
    kinds: TokenKinds
    named_unused: list[int]


def facts_of(vocab: Vocab, merged: frozenset[str] | None) -> VocabFacts:
    """Find the facts (`merged`: what a byte-level GGUF's merges build, when known), the
    vocabulary's entries read once for all of them."""
    read = read_entries(vocab)
    unreachable, kinds = find_unreachable(vocab, read, merged)
    return VocabFacts(
        fingerprint(vocab, read.raw), unreachable, TokenKinds.of(kinds), named_unused(read.pieces)
    )


def named_unused(pieces: list[str | None]) -> list[int]:
    """The ids whose entry names itself unused or reserved (<unused12>, [unused7], ...)."""
    return [i for i, p in enumerate(pieces) if p and p[0] in "<[" and _UNUSED_NAME.match(p)]


def model_vocab(source: ModelSource, gguf: GGUFHeader | None) -> tuple[Vocab, VocabFacts]:
    """The model's own vocabulary and its facts: for a GGUF, those kept for its tokenizer
    metadata (the tokenizer left unbuilt until asked for), else found and kept."""
    if gguf is None:
        vocab = load_vocab(source)
        return vocab, facts_of(vocab, None)
    name = f"{gguf_cache.tokenizer_key(gguf)}.vocab{FORMAT}"
    kept = _read(gguf_cache.load_bytes(name), gguf)
    if kept is not None:
        return kept
    vocab = load_vocab(source, gguf)
    facts = facts_of(vocab, byte_level_merge_results(gguf))
    gguf_cache.store_bytes(name, _written(vocab, facts))
    return vocab, facts


# A kept entry: _MAGIC, the length of a JSON header (8 bytes, little-endian), the header, then
# the arrays it names, each of native uint32 ('I') or uint8 ('B') items, in _ARRAYS' order.
_MAGIC = f"embedlens vocab facts {FORMAT} {sys.byteorder}\n".encode()
_ARRAYS = (("kind_ids", "I"), ("kind_codes", "B"), ("text_ends", "I"))


def _written(vocab: Vocab, facts: VocabFacts) -> bytes:
    """The entry's bytes: the small facts as JSON, every id's text packed (PackedTexts)."""
    kinds = facts.kinds
    names = list(kinds.names)
    texts = [vocab.text(i).encode("utf-8", "surrogatepass") for i in range(vocab.size)]
    arrays = {
        "kind_ids": array("I", kinds.ids.tolist()),
        "kind_codes": array("B", kinds.codes.tolist()),
        "text_ends": array("I", accumulate(map(len, texts))),
    }
    header = {
        "size": vocab.size,
        "special_ids": sorted(vocab.special_ids),
        "unk_id": vocab.unk_id,
        "added": sorted(vocab.added),
        "fingerprint": facts.fingerprint,
        "unreachable": {
            "count": facts.unreachable.count,
            "by_kind": facts.unreachable.by_kind,
            "tokens": [[t.id, t.token, t.kind, t.encodes_as] for t in facts.unreachable.tokens],
        },
        "kind_names": names,
        "named_unused": facts.named_unused,
        "counts": {k: len(a) for k, a in arrays.items()},
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    body = b"".join(arrays[k].tobytes() for k, _ in _ARRAYS)
    return _MAGIC + len(head).to_bytes(8, "little") + head + body + b"".join(texts)


def _read(data: bytes | None, gguf: GGUFHeader) -> tuple[Vocab, VocabFacts] | None:
    """The vocabulary and facts kept in `data`; None when there is none or it is damaged."""
    if data is None or not data.startswith(_MAGIC):
        return None
    try:
        view = memoryview(data)
        at = len(_MAGIC) + 8
        end = at + int.from_bytes(view[at - 8 : at], "little")
        header = json.loads(view[at:end].tobytes())
        arrays: dict[str, memoryview] = {}
        for key, code in _ARRAYS:
            n = int(header["counts"][key]) * (4 if code == "I" else 1)
            part = view[end : end + n]
            arrays[key] = part.cast("I") if code == "I" else part.cast("B")
            end += n
        ends = arrays["text_ends"]
        if len(ends) != int(header["size"]) or (len(ends) and ends[-1] != len(view) - end):
            return None
        texts = PackedTexts(ends, view[end:])
        return _vocab(header, texts, gguf), _facts(header, arrays)
    except (ValueError, KeyError, TypeError, IndexError):
        return None


def _vocab(header: dict[str, Any], texts: PackedTexts, gguf: GGUFHeader) -> Vocab:
    unk = header["unk_id"]
    return Vocab(
        None,
        int(header["size"]),
        frozenset(int(i) for i in header["special_ids"]),
        None if unk is None else int(unk),
        GGUF_ORIGIN,
        added=frozenset(int(i) for i in header["added"]),
        texts=texts,
        loads=lambda: vocab_from_gguf(gguf),
    )


def _facts(header: dict[str, Any], arrays: dict[str, memoryview]) -> VocabFacts:
    listed = header["unreachable"]
    tokens = [UnreachableToken(int(i), str(t), str(k), list(e)) for i, t, k, e in listed["tokens"]]
    unreachable = Unreachable(int(listed["count"]), dict(listed["by_kind"]), tokens)
    names = tuple(str(n) for n in header["kind_names"])
    ids = np.frombuffer(arrays["kind_ids"], dtype=np.uint32).astype(np.int64)
    codes = np.frombuffer(arrays["kind_codes"], dtype=np.uint8)
    if ids.size != codes.size or np.any(ids[1:] <= ids[:-1]) or np.any(codes >= len(names)):
        raise ValueError("damaged kinds")  # read as no entry: the facts are found again
    kinds = TokenKinds(ids, codes, names)
    return VocabFacts(str(header["fingerprint"]), unreachable, kinds, list(header["named_unused"]))
