"""A GGUF vocabulary that reads a few words from the pieces they can be made of (gguf_words)
encodes, looks up and shows tokens exactly as the whole tokenizer does, without building it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from embedlens.io.gguf import read_gguf_header
from embedlens.model import tokenizer
from embedlens.model.gguf_words import gguf_words_vocab
from embedlens.model.tokenizer import Vocab, vocab_from_gguf
from tests.gemma_vocab import WORDS, gemma_like_vocab, write_gemma_like_gguf
from tests.test_vocab import _write_gguf
from tests.test_vocab_command import _bpe_gguf

PROBES = [
    *WORDS,
    *(" " + w for w in WORDS),
    *(w.upper() for w in WORDS),
    "the king and the queen",
    "  king",
    "king ",
    "<bos>king",
    "<start_of_turn>user\nhi<end_of_turn>",
    "\n\n",
    "四x",
    "café au lait",
    "😀 ☃",
    "ab abab abc xy",
    "é x",
    "Ġk",
    "",
    " ",
    "a" * 40,
]


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBEDLENS_CACHE", str(tmp_path / "cache"))


def _whole_builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    built: list[str] = []
    real = tokenizer.vocab_from_gguf

    def counted(*args: Any) -> Any:
        built.append("whole")
        return real(*args)

    monkeypatch.setattr(tokenizer, "vocab_from_gguf", counted)
    return built


def _same(
    path: Path, monkeypatch: pytest.MonkeyPatch, *, repeated: bool = False
) -> tuple[Vocab, Vocab]:
    """The words vocabulary answers as the whole one for every probe, id and piece (`repeated`:
    an entry's later id is shown by the whole tokenizer, built once)."""
    whole = vocab_from_gguf(read_gguf_header(path))
    built = _whole_builds(monkeypatch)
    words = gguf_words_vocab(read_gguf_header(path))
    assert words.built is None
    facts = (words.size, words.special_ids, words.added, words.unk_id, words.origin)
    assert facts == (whole.size, whole.special_ids, whole.added, whole.unk_id, whole.origin)
    assert whole.pieces is not None
    for text in [*PROBES, *(p for p in whole.pieces[:400] if p)]:
        assert words.encode(text) == whole.encode(text), text
        assert words.lookup(text) == whole.lookup(text), text
    ids = [*range(min(whole.size, 400)), *range(0, whole.size, 97), whole.size - 1]
    assert [words.text(i) for i in ids] == [whole.text(i) for i in ids]
    assert [words.piece(i) for i in ids] == [whole.piece(i) for i in ids]
    assert built == (["whole"] if repeated else [])  # else the words' pieces alone
    return words, whole


@pytest.mark.parametrize("add_space", [True, False])
def test_sentencepiece_scored_without_merges(tmp_path, monkeypatch, add_space):
    """Gemma 3's layout: control, unused (user-defined) and byte pieces, merges implied by the
    scores; with and without a space prefix."""
    import gguf

    tokens, scores, types = gemma_like_vocab(3000)
    path = tmp_path / "sp.gguf"
    _write_gguf(path, tokens, model="llama", scores=scores, types=types)
    if not add_space:
        writer = gguf.GGUFWriter(str(path), "llama")  # rewritten with the flag off
        writer.add_block_count(1)
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_add_space_prefix(False)
        writer.add_unk_token_id(3)
        import numpy as np

        writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    _same(path, monkeypatch)


def test_sentencepiece_with_merges(tmp_path, monkeypatch):
    from tests.test_vocab import _sentencepiece_vocab

    tokens, scores, types = _sentencepiece_vocab()
    merges = []
    for piece in tokens[259:]:
        if len(piece) > 1 and piece[:-1] in tokens and piece[-1] in tokens:
            merges.append(f"{piece[:-1]} {piece[-1]}")
    path = _write_gguf(
        tmp_path / "spm.gguf", tokens, model="llama", scores=scores, types=types, merges=merges
    )
    _same(path, monkeypatch)


def test_byte_level_with_repeated_and_text_entries(tmp_path, monkeypatch):
    """Merges, an entry repeated (its later id asks the whole tokenizer), one stored as text."""
    extra = ["ab", "abc", "xy", "ab", "é x", "abab", "Ġk", "in", "Ġkin", "Ġking", "ing"]
    merges = ["a b", "ab ab", "Ġ k", "i n", "Ġk in", "Ġkin g", "in g"]
    path = _bpe_gguf(tmp_path / "bpe.gguf", extra, merges)
    words, whole = _same(path, monkeypatch, repeated=True)
    assert words.text(259) == whole.text(259)  # the repeated 'ab'


def test_smollm2(smollm2, monkeypatch):
    """SmolLM2's byte-level vocabulary: 49,152 entries, 48,900 merges, control tokens."""
    _same(smollm2, monkeypatch)


@pytest.mark.slow
def test_gemma_sized(tmp_path, monkeypatch):
    """262,144 scored pieces: every probe as the whole tokenizer, which is never built."""
    path = write_gemma_like_gguf(tmp_path / "gemma.gguf")
    _same(path, monkeypatch)


def test_neighbors_and_addr_with_words_build_no_whole_tokenizer(tmp_path, monkeypatch, cli):
    tokens, scores, types = gemma_like_vocab(3000)
    path = _write_gguf(tmp_path / "sp.gguf", tokens, model="llama", scores=scores, types=types)
    built = _whole_builds(monkeypatch)
    shown = cli.json("neighbors", path, "king", " queen", "-k", "3")
    rows = cli.json("addr", path, "king", "42")
    assert built == []
    whole = vocab_from_gguf(read_gguf_header(path))
    (king,) = whole.encode("king")
    assert shown["queries"][0]["tokens"][0]["id"] == king
    assert [r["token"] for r in rows["rows"]] == [whole.text(king), whole.text(42)]
    assert [n["token"] for n in shown["queries"][0]["neighbors"]] == [
        whole.text(n["id"]) for n in shown["queries"][0]["neighbors"]
    ]
