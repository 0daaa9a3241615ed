"""GGUF tokenizers kept in embedlens' cache: built once, loaded back unchanged, rebuilt when the
file's tokenizer changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from embedlens.io.gguf import read_gguf_header
from embedlens.model import gguf_cache, gguf_vocab, tokenizer
from embedlens.model.tokenizer import Vocab, vocab_from_gguf
from tests.gemma_vocab import WORDS, gemma_like_vocab, write_gemma_like_gguf
from tests.test_vocab import _write_gguf

PROBES = [*WORDS, *(" " + w for w in WORDS), "the king and the queen", "<bos>king", "\n\n", "四x"]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("EMBEDLENS_CACHE", str(folder))
    return folder / "tokenizers"


def _builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record each whole build of a GGUF tokenizer (calling through)."""
    built: list[str] = []
    real = tokenizer.build_gguf_tokenizer

    def counted(*args: Any) -> Any:
        built.append("built")
        return real(*args)

    monkeypatch.setattr(tokenizer, "build_gguf_tokenizer", counted)
    return built


def _facts(vocab: Vocab) -> tuple[Any, ...]:
    """Everything a command reads from a vocabulary: encodings, every token's text and entry,
    its size, special and unknown ids."""
    texts = [vocab.text(i) for i in range(vocab.size)]
    encoded = [vocab.encode(p) for p in PROBES]
    return encoded, texts, vocab.pieces, vocab.size, vocab.special_ids, vocab.unk_id


def _sentencepiece_file(path: Path, n: int = 4000, **change: Any) -> Path:
    tokens, scores, types = gemma_like_vocab(n)
    for i, piece in change.get("tokens", {}).items():
        tokens[i] = piece
    return _write_gguf(path, tokens, model="llama", scores=scores, types=types)


def test_second_load_comes_from_the_cache(tmp_path, cache, monkeypatch):
    path = _sentencepiece_file(tmp_path / "sp.gguf")
    built = _builds(monkeypatch)
    first = vocab_from_gguf(read_gguf_header(path))
    assert built == ["built"] and len(list(cache.glob("*.json"))) == 1
    second = vocab_from_gguf(read_gguf_header(path))
    assert built == ["built"]  # loaded back, not rebuilt
    assert _facts(second) == _facts(first)


def test_a_changed_tokenizer_is_rebuilt(tmp_path, cache, monkeypatch):
    """A file rewritten with one piece changed gets its own entry; the old one is not used."""
    path = _sentencepiece_file(tmp_path / "sp.gguf")
    old = vocab_from_gguf(read_gguf_header(path))
    king = old.encode("king")
    assert len(king) == 1
    _sentencepiece_file(path, tokens={king[0]: "kinq"})
    built = _builds(monkeypatch)
    new = vocab_from_gguf(read_gguf_header(path))
    assert built == ["built"] and len(list(cache.glob("*.json"))) == 2
    assert new.encode("king") != king and new.text(king[0]) == "kinq"
    monkeypatch.setenv("EMBEDLENS_CACHE", str(tmp_path / "fresh"))
    assert _facts(new) == _facts(vocab_from_gguf(read_gguf_header(path)))


def test_new_weights_keep_the_entry(tmp_path, cache, monkeypatch):
    """The key is the tokenizer metadata: another file with the same tokenizer and other
    weights loads the kept tokenizer, which is the one it would build."""
    tokens, scores, types = gemma_like_vocab(4000)
    a = _write_gguf(tmp_path / "a.gguf", tokens, model="llama", scores=scores, types=types)
    vocab_from_gguf(read_gguf_header(a))
    b = tmp_path / "b.gguf"
    b.write_bytes(a.read_bytes()[:-64] + bytes(64))  # the last weights zeroed
    built = _builds(monkeypatch)
    kept = vocab_from_gguf(read_gguf_header(b))
    assert built == []
    monkeypatch.setenv("EMBEDLENS_CACHE", str(tmp_path / "fresh"))
    assert _facts(kept) == _facts(vocab_from_gguf(read_gguf_header(b)))


def test_a_damaged_entry_is_rebuilt(tmp_path, cache, monkeypatch):
    path = _sentencepiece_file(tmp_path / "sp.gguf")
    whole = _facts(vocab_from_gguf(read_gguf_header(path)))
    (entry,) = cache.glob("*.json")
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    built = _builds(monkeypatch)
    assert _facts(vocab_from_gguf(read_gguf_header(path))) == whole
    assert built == ["built"]
    assert _facts(vocab_from_gguf(read_gguf_header(path))) == whole  # the entry written again
    assert built == ["built"]


def test_an_unwritable_cache_is_left_alone(tmp_path, monkeypatch, cli):
    path = _sentencepiece_file(tmp_path / "sp.gguf")
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("EMBEDLENS_CACHE", str(blocker))
    built = _builds(monkeypatch)
    vocab_from_gguf(read_gguf_header(path))
    vocab_from_gguf(read_gguf_header(path))
    assert built == ["built", "built"] and blocker.read_text() == ""
    assert cli.json("addr", path, "king")["rows"]


def test_default_folder_is_under_hf_home(monkeypatch, hf_home):
    monkeypatch.delenv("EMBEDLENS_CACHE", raising=False)
    assert gguf_cache.cache_dir() == hf_home / "embedlens" / "tokenizers"


def test_byte_level_vocabulary_is_kept_alike(tmp_path, cache, monkeypatch):
    """A 'gpt2' vocabulary (respelled entries, merges, a split pattern) loads back the same."""
    from embedlens.model.tokens import byte_alphabet

    letters = list(byte_alphabet().values())
    tokens = [*letters, "Ġk", "in", "Ġkin", "Ġking", "ĊĠ", "<|end|>", "é"]
    types = [1] * len(letters) + [1, 1, 1, 1, 1, 3, 1]
    merges = ["Ġ k", "i n", "Ġk in", "Ġkin g", "Ċ Ġ"]
    path = _write_gguf(tmp_path / "bl.gguf", tokens, model="gpt2", merges=merges, types=types)
    first = vocab_from_gguf(read_gguf_header(path))
    built = _builds(monkeypatch)
    assert _facts(vocab_from_gguf(read_gguf_header(path))) == _facts(first) and built == []


def test_numeric_arrays_read_whole_as_item_by_item(tmp_path):
    """Scores and token types unpacked in one call are what LazyArray.read decodes."""
    path = _sentencepiece_file(tmp_path / "sp.gguf", n=1000)
    header = read_gguf_header(path)
    meta = gguf_vocab.gguf_tokenizer(header)
    assert meta.scores == header.metadata["tokenizer.ggml.scores"].read()
    assert meta.types == header.metadata["tokenizer.ggml.token_type"].read()


@pytest.mark.slow
def test_gemma_sized_vocabulary(tmp_path, cache, monkeypatch):
    """262,144 scored pieces without merges (Gemma 3): built once, then loaded back with the
    same encodings and texts."""
    path = write_gemma_like_gguf(tmp_path / "gemma.gguf")
    first = vocab_from_gguf(read_gguf_header(path))
    built = _builds(monkeypatch)
    second = vocab_from_gguf(read_gguf_header(path))
    assert built == []
    assert [first.encode(p) for p in PROBES] == [second.encode(p) for p in PROBES]
    ids = range(0, first.size, 251)
    assert [first.text(i) for i in ids] == [second.text(i) for i in ids]
    assert (first.pieces, first.special_ids) == (second.pieces, second.special_ids)


TARGET_WORDS = [
    *("king queen Paris the a of and is was dog cats running Überall café naïve".split()),
    *("北京 四 東京 😀 ☃ 123 2024 3.14 , . ! ? ' \" - ( ) <|im_start|> <|endoftext|>".split()),
    *("don't U.S.A. e-mail @home #tag $5 100% CamelCase snake_case".split()),
    "\n", "\t", "  ", "",
]  # fmt: skip


@pytest.mark.slow
def test_gguf_vocab_encodes_as_the_lens_tokenizer(smollm2, tmp_path, monkeypatch):
    """SmolLM2's GGUF: embedlens' own tokenizer, built and kept, encodes every word, bare and
    after a space, to the ids of the transformers tokenizer `lens` uses, and calls the same
    ids special and unknown: a --target could be checked with it before transformers loads."""
    from embedlens.io.source import resolve
    from embedlens.model.loading import load_tokenizer
    from embedlens.model.tokenizer import load_vocab

    source = resolve(str(smollm2), None)
    monkeypatch.setenv("EMBEDLENS_CACHE", str(tmp_path / "kept"))
    hf = load_tokenizer(source)  # its checks build embedlens' tokenizer, and keep it
    kept = load_vocab(source)
    monkeypatch.setenv("EMBEDLENS_CACHE", str(tmp_path / "fresh"))
    built = _builds(monkeypatch)
    for vocab in (kept, load_vocab(source)):
        for word in TARGET_WORDS:
            for text in (word, " " + word):
                expected = list(hf(text, add_special_tokens=False)["input_ids"])
                assert vocab.encode(text) == expected, text
        assert vocab.size == len(hf) and vocab.unk_id == hf.unk_token_id
        assert vocab.special_ids >= set(hf.all_special_ids)
    assert built == ["built"]
