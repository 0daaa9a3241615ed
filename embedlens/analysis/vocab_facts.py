"""What `vocab` reads from a tokenizer alone, and for a GGUF, kept beside its built tokenizer.

The tokens the tokenizer never produces, the vocabulary's fingerprint, the entries named unused,
and every id's text with the added and special ids depend on the tokenizer only; finding the
unreachable tokens decodes and encodes every token. For a GGUF file they are kept in the
tokenizer cache (`tokenizer_cache`) under the tokenizer's key and this module's FORMAT, so a later
`vocab` on a file with the same tokenizer metadata reads them back instead of building the
tokenizer (which is then built only if something else asks for it: --against, --verify,
--check-fit). A missing or damaged entry means they are found again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from embedlens.analysis.vocab_fingerprint import entries, fingerprint, pieces_by_id
from embedlens.analysis.vocab_layout import find_unreachable, named_unused
from embedlens.io.gguf import GGUFHeader
from embedlens.io.source import ModelSource
from embedlens.model import tokenizer_cache
from embedlens.model.tokenizer import (
    Vocab,
    byte_level_merge_results,
    load_vocab,
    vocab_from_gguf,
)
from embedlens.reports.vocab import Unreachable, UnreachableToken

FORMAT = 1
"""Raise when what is kept, or how it is found, changes."""
GGUF_ORIGIN = "GGUF metadata"


@dataclass(frozen=True)
class VocabFacts:
    """A tokenizer's own facts: its fingerprint, the tokens it never produces (the report and
    every such id's kind) and the ids of entries named unused."""

    fingerprint: str
    unreachable: Unreachable
    kinds: dict[int, str]
    named_unused: list[int]


def facts_of(vocab: Vocab, merged: frozenset[str] | None) -> VocabFacts:
    """Find the facts (`merged`: what a byte-level GGUF's merges build, when known)."""
    pieces = pieces_by_id(vocab)
    raw = entries(vocab, pieces)
    unreachable, kinds = find_unreachable(vocab, vocab.size, pieces, raw, merged)
    return VocabFacts(fingerprint(vocab, raw), unreachable, kinds, named_unused(pieces))


def model_vocab(source: ModelSource, gguf: GGUFHeader | None) -> tuple[Vocab, VocabFacts]:
    """The model's own vocabulary and its facts: for a GGUF, those kept for its tokenizer
    metadata (the tokenizer left unbuilt until asked for), else found and kept."""
    if gguf is None:
        vocab = load_vocab(source)
        return vocab, facts_of(vocab, None)
    name = f"{tokenizer_cache.tokenizer_key(gguf)}.vocab{FORMAT}.json"
    kept = _read(tokenizer_cache.load_text(name), gguf)
    if kept is not None:
        return kept
    vocab = load_vocab(source, gguf)
    facts = facts_of(vocab, byte_level_merge_results(gguf))
    tokenizer_cache.store_text(name, _written(vocab, facts))
    return vocab, facts


def _written(vocab: Vocab, facts: VocabFacts) -> str:
    names = sorted(set(facts.kinds.values()))
    code = {k: n for n, k in enumerate(names)}
    data = {
        "size": vocab.size,
        "special_ids": sorted(vocab.special_ids),
        "unk_id": vocab.unk_id,
        "added": sorted(vocab.added),
        "texts": [vocab.text(i) for i in range(vocab.size)],
        "fingerprint": facts.fingerprint,
        "unreachable": {
            "count": facts.unreachable.count,
            "by_kind": facts.unreachable.by_kind,
            "tokens": [[t.id, t.token, t.kind, t.encodes_as] for t in facts.unreachable.tokens],
        },
        "kind_names": names,
        "kind_ids": list(facts.kinds),
        "kind_codes": [code[k] for k in facts.kinds.values()],
        "named_unused": facts.named_unused,
    }
    return json.dumps(data, separators=(",", ":"))


def _read(text: str | None, gguf: GGUFHeader) -> tuple[Vocab, VocabFacts] | None:
    """The vocabulary and facts kept in `text`; None when there is none or it is damaged."""
    if text is None:
        return None
    try:
        data = json.loads(text)
        return _vocab(data, gguf), _facts(data)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None


def _vocab(data: dict[str, Any], gguf: GGUFHeader) -> Vocab:
    size, texts = int(data["size"]), tuple(data["texts"])
    if len(texts) != size or not all(isinstance(t, str) for t in texts):
        raise ValueError("the kept texts do not cover the vocabulary")
    unk = data["unk_id"]
    return Vocab(
        None,
        size,
        frozenset(int(i) for i in data["special_ids"]),
        None if unk is None else int(unk),
        GGUF_ORIGIN,
        added=frozenset(int(i) for i in data["added"]),
        texts=texts,
        loads=lambda: vocab_from_gguf(gguf),
    )


def _facts(data: dict[str, Any]) -> VocabFacts:
    listed = data["unreachable"]
    tokens = [UnreachableToken(int(i), str(t), str(k), list(e)) for i, t, k, e in listed["tokens"]]
    unreachable = Unreachable(int(listed["count"]), dict(listed["by_kind"]), tokens)
    names = data["kind_names"]
    kinds = dict(zip(data["kind_ids"], map(names.__getitem__, data["kind_codes"]), strict=True))
    return VocabFacts(str(data["fingerprint"]), unreachable, kinds, list(data["named_unused"]))
