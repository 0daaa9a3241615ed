"""`vocab` on a GGUF keeps what it reads from the tokenizer alone beside the built tokenizer: a
second run reads it back and builds no tokenizer, with the same report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import embedlens
from embedlens.analysis.vocab import facts as vocab_facts
from embedlens.model import gguf_cache, tokenizer
from tests.gemma_vocab import gemma_like_vocab
from tests.test_vocab import _write_gguf
from tests.test_vocab_command import _bpe_gguf


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("EMBEDLENS_CACHE", str(folder))
    return folder / "tokenizers"


def _tokenizer_work(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every build or load of a GGUF tokenizer and every search for unreachable tokens
    (calling through)."""
    done: list[str] = []

    def counted(name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            done.append(name)
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(tokenizer, "vocab_from_gguf", counted("built", tokenizer.vocab_from_gguf))
    monkeypatch.setattr(gguf_cache, "load_tokenizer", counted("loaded", gguf_cache.load_tokenizer))
    monkeypatch.setattr(
        vocab_facts, "find_unreachable", counted("searched", vocab_facts.find_unreachable)
    )
    monkeypatch.setattr(vocab_facts, "load_vocab", counted("built", vocab_facts.load_vocab))
    monkeypatch.setattr(
        vocab_facts, "vocab_from_gguf", counted("built", vocab_facts.vocab_from_gguf)
    )
    return done


def _sentencepiece(path: Path, n: int = 3000) -> Path:
    tokens, scores, types = gemma_like_vocab(n)
    return _write_gguf(path, tokens, model="llama", scores=scores, types=types)


@pytest.mark.parametrize("kind", ["sentencepiece", "byte-level"])
def test_second_run_reads_the_kept_facts(tmp_path, cache, monkeypatch, kind):
    if kind == "sentencepiece":
        path = _sentencepiece(tmp_path / "sp.gguf")
    else:  # unmerged pieces, a repeated entry, one stored as text
        extra = ["ab", "abc", "xy", "ab", "é x", "abab"]
        path = _bpe_gguf(tmp_path / "bpe.gguf", extra, ["a b", "ab ab"])
    first = embedlens.vocab(path, show_all=True).to_dict()
    assert len(list(cache.glob("*.vocab*"))) == 1
    done = _tokenizer_work(monkeypatch)
    second = embedlens.vocab(path, show_all=True).to_dict()
    assert done == []  # no tokenizer built or loaded, no token decoded or encoded
    assert second == first
    assert first["unreachable"]["count"] and first["undertrained"]["reference_count"]


def test_options_that_need_the_tokenizer_build_it(tmp_path, cache, monkeypatch):
    """--against with kept facts builds the tokenizer when it compares: the same report as
    without the cache."""
    path = _sentencepiece(tmp_path / "sp.gguf")
    other = _sentencepiece(tmp_path / "other.gguf", n=2990)
    embedlens.vocab(path)
    done = _tokenizer_work(monkeypatch)
    kept = embedlens.vocab(path, against=other).to_dict()
    assert "built" in done and "searched" not in done
    monkeypatch.setenv("EMBEDLENS_CACHE", str(tmp_path / "fresh"))
    assert kept == embedlens.vocab(path, against=other).to_dict()
    assert kept["against"]["compatible"] is not None


def test_a_damaged_entry_is_found_again(tmp_path, cache, monkeypatch):
    path = _sentencepiece(tmp_path / "sp.gguf")
    whole = embedlens.vocab(path).to_dict()
    (entry,) = cache.glob("*.vocab*")
    entry.write_bytes(entry.read_bytes()[:-100])
    done = _tokenizer_work(monkeypatch)
    assert embedlens.vocab(path).to_dict() == whole
    assert "searched" in done
    done.clear()
    assert embedlens.vocab(path).to_dict() == whole  # written again
    assert done == []


def test_kept_kinds_out_of_order_are_found_again(tmp_path, cache, monkeypatch):
    """An entry whose token kinds are not in ascending id order (or name no kind) is damaged:
    the facts are found again, and the report is the same."""
    import json

    path = _sentencepiece(tmp_path / "sp.gguf")
    whole = embedlens.vocab(path).to_dict()
    (entry,) = cache.glob("*.vocab*")
    data = bytearray(entry.read_bytes())
    at = len(vocab_facts._MAGIC) + 8
    end = at + int.from_bytes(data[at - 8 : at], "little")
    counts = json.loads(data[at:end])["counts"]
    assert counts["kind_ids"] >= 2
    first = data[end : end + 4]
    data[end : end + 4] = data[end + 4 : end + 8]  # the first two ids swapped
    data[end + 4 : end + 8] = first
    entry.write_bytes(bytes(data))
    done = _tokenizer_work(monkeypatch)
    assert embedlens.vocab(path).to_dict() == whole
    assert "searched" in done


def test_a_changed_tokenizer_gets_facts_of_its_own(tmp_path, cache, monkeypatch):
    tokens, scores, types = gemma_like_vocab(3000)
    path = _write_gguf(tmp_path / "sp.gguf", tokens, model="llama", scores=scores, types=types)
    before = embedlens.vocab(path).to_dict()
    tokens[2990] = "<unused_new>"
    _write_gguf(path, tokens, model="llama", scores=scores, types=types)
    after = embedlens.vocab(path).to_dict()
    assert len(list(cache.glob("*.vocab*"))) == 2
    assert after["fingerprint"]["sha256"] != before["fingerprint"]["sha256"]
    assert after["undertrained"]["reference_by_kind"].get("named_unused", 0) == (
        before["undertrained"]["reference_by_kind"].get("named_unused", 0) + 1
    )


def test_an_unwritable_cache_is_left_alone(tmp_path, monkeypatch, cli):
    path = _sentencepiece(tmp_path / "sp.gguf")
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("EMBEDLENS_CACHE", str(blocker))
    first = cli.json("vocab", path)
    assert cli.json("vocab", path) == first and blocker.read_text() == ""


def test_kept_vocabulary_shows_what_the_built_one_shows(tmp_path, cache):
    """Every id's text, the special, added and unknown ids, read back, are the built ones'
    (byte pieces, partial UTF-8, control and unused tokens among them)."""
    from embedlens.io.gguf import read_gguf_header
    from embedlens.io.source import resolve

    path = _sentencepiece(tmp_path / "sp.gguf")
    source = resolve(str(path))
    header = read_gguf_header(path)
    built, found = vocab_facts.model_vocab(source, header)
    kept, read = vocab_facts.model_vocab(source, header)
    assert built.built is not None and kept.built is None
    assert read == found
    assert [kept.text(i) for i in range(kept.size)] == [built.text(i) for i in range(built.size)]
    assert (kept.size, kept.special_ids, kept.added, kept.unk_id, kept.origin) == (
        built.size,
        built.special_ids,
        built.added,
        built.unk_id,
        built.origin,
    )
    assert kept.encode(" the king") == built.encode(" the king")  # built when asked
    assert kept.built is None and kept.whole().built is not None
