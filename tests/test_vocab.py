"""Tokenizers rebuilt from GGUF metadata encode as transformers' GGUF loader does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from embedlens.io.gguf import read_gguf_header
from embedlens.model.tokenizer import vocab_from_file, vocab_from_gguf

WORDS = ["king", "queen", "the", "he", "she", "cat", "cats", "dog"]
PROBES = [
    "king",
    " king",
    "the king and the queen",
    "  two  spaces",
    "cats dog",
    "café",
    "<s>king</s>",
    "\n",
    "北",
]


def _sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """<unk>, <s>, </s>, 256 byte pieces, characters, then merged pieces best-first."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    chars = sorted({c for w in WORDS for c in "▁" + w})
    merged: list[str] = []
    for word in WORDS:  # every prefix of '▁word' of two characters or more
        piece = "▁" + word
        merged += [piece[:i] for i in range(2, len(piece) + 1) if piece[:i] not in merged]
    pieces = chars + merged
    tokens += pieces
    types += [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(chars))]
    scores += [-float(len(chars) + i) for i in range(len(merged))][::-1]
    return tokens, scores, types


def _write_gguf(path: Path, tokens: list[str], *, model: str, **arrays: list) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    if "scores" in arrays:
        writer.add_token_scores(arrays["scores"])
    if "merges" in arrays:
        writer.add_token_merges(arrays["merges"])
    writer.add_token_types(arrays["types"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.normal(size=(len(tokens), 32)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _transformers_ids(path: Path, text: str, cache: dict) -> list[int]:
    from transformers import AutoTokenizer

    if path not in cache:
        cache[path] = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return list(cache[path].encode(text, add_special_tokens=False))


def test_sentencepiece_gguf_matches_transformers(tmp_path):
    tokens, scores, types = _sentencepiece_vocab()
    path = _write_gguf(tmp_path / "sp.gguf", tokens, model="llama", scores=scores, types=types)
    vocab = vocab_from_gguf(read_gguf_header(path))
    assert vocab.size == len(tokens) and vocab.special_ids == {1, 2}
    cache: dict = {}
    for text in PROBES:
        assert vocab.encode(text) == _transformers_ids(path, text, cache), text
    king = vocab.encode(" king")
    assert [tokens[i] for i in king] == ["▁king"]
    assert vocab.text(king[0]) == " king"  # a lone token keeps its leading space
    e_acute = vocab.encode("é")  # '▁', then byte fallback: two pieces, each shown by its byte
    assert [vocab.text(i) for i in e_acute] == [" ", "\\xc3", "\\xa9"]


def test_byte_level_gguf_matches_transformers(tmp_path, tiny):
    """A byte-level vocabulary (tokenizer.ggml.model 'gpt2') built from tokenizer.json's BPE."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([" ".join(WORDS) * 3, "the king and the queen", "café 北京"], trainer)
    vocab_map = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab_map.items(), key=lambda kv: kv[1])]
    import json

    merges = [
        " ".join(m) if isinstance(m, list) else m
        for m in json.loads(tok.to_str())["model"]["merges"]
    ]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    path = _write_gguf(tmp_path / "bl.gguf", tokens, model="gpt2", merges=merges, types=types)
    vocab = vocab_from_gguf(read_gguf_header(path))
    assert vocab.special_ids == {0, 1, 2}
    cache: dict = {}
    for text in PROBES:
        assert vocab.encode(text) == _transformers_ids(path, text, cache), text


def test_tokenizer_json(tiny):
    vocab = vocab_from_file(tiny("llama-tied") / "tokenizer.json")
    assert vocab.size == 58 and vocab.special_ids == {0, 1, 2, 3} and vocab.unk_id == 0
    assert vocab.encode("king queen") == [15, 16] and vocab.text(15) == "king"


def test_unsupported_gguf_tokenizer(tmp_path, cli):
    tokens, _, types = _sentencepiece_vocab()
    path = _write_gguf(tmp_path / "bert.gguf", tokens, model="bert", types=types)
    err = cli.fails("neighbors", path, "king", code=1)
    assert "has a 'bert' tokenizer" in err


@pytest.mark.parametrize("command", ["neighbors", "addr"])
def test_commands_on_a_sentencepiece_gguf(tmp_path, cli, command):
    tokens, scores, types = _sentencepiece_vocab()
    path = _write_gguf(tmp_path / "sp.gguf", tokens, model="llama", scores=scores, types=types)
    data = cli.json(command, path, " king")
    if command == "neighbors":
        q = data["queries"][0]
        assert q["token"] == " king" and tokens[q["token_id"]] == "▁king"
        assert data["searched_rows"] == len(tokens) - 2  # <s> and </s> are control tokens
    else:
        (row,) = data["rows"]
        assert data["dtype"] == "F32" and row["token"] == " king" and row["check"] is True


def _texts(vocab, ids):
    return [vocab.text(i) for i in ids], vocab.size, {i for i in vocab.special_ids if i in ids}


def test_rows_vocab_shows_what_the_whole_one_shows(tmp_path, smollm2):
    """gguf_rows_vocab reads only the ids asked for; their texts (byte tokens, '▁' pieces,
    control and user-defined tokens, SmolLM2's whole byte-level vocabulary) and the size are
    those of the tokenizer rebuilt whole, and it refuses to encode."""
    from embedlens.model.tokenizer import gguf_rows_vocab

    tokens, scores, types = _sentencepiece_vocab()
    types[tokens.index("▁king")] = 4  # user-defined
    sp = _write_gguf(tmp_path / "sp.gguf", tokens, model="llama", scores=scores, types=types)
    for path in (sp, smollm2):
        header = read_gguf_header(path)
        whole = vocab_from_gguf(header)
        ids = list(range(whole.size))
        assert _texts(gguf_rows_vocab(header, ids), ids) == _texts(whole, ids)
        few = [whole.size - 1, 3, 1]
        assert _texts(gguf_rows_vocab(header, few), few) == _texts(whole, few)
    with pytest.raises(ValueError, match="only some ids"):
        gguf_rows_vocab(header, [1]).encode("king")
