"""`addr`: row addresses from headers, read back byte for byte from safetensors and GGUF files."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.models import SPECIALS, TOKENIZER_LEN, VOCAB, WORDS, write_config
from tests.smol_reference import smol_table

ID = {t: i for i, t in enumerate(SPECIALS + WORDS)}
D = 32
CONFIGS = Path(__file__).parent / "configs"


def header_offset(path: Path, name: str) -> int:
    """Absolute offset of a tensor's first byte, from the safetensors header parsed here."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    return 8 + n + header[name]["data_offsets"][0]


def read_at(path: Path, offset: int, size: int) -> bytes:
    with open(path, "rb") as fh:
        fh.seek(offset)
        return fh.read(size)


def torch_row_bytes(path: Path, name: str, row: int) -> bytes:
    """The row as torch loads it through safetensors, as raw bytes."""
    import torch
    from safetensors.torch import load_file

    t = load_file(path)[name][row].contiguous()
    return t.view(torch.uint8).numpy().tobytes()


@pytest.mark.slow
def test_float32_rows(cli, tiny):
    folder = tiny("llama-tied")
    name = "model.embed_tokens.weight"
    data = cli.json("addr", folder, "0", "king", str(VOCAB - 1))
    assert data["command"] == "addr" and data["tensor"] == name and data["format"] == "safetensors"
    assert data["shape"] == [VOCAB, D] and data["dtype"] == "float32"
    assert data["element_size"] == 4 and data["stride"] == [D, 1]
    assert data["row_bytes"] == D * 4 and data["table_bytes"] == VOCAB * D * 4
    weights = folder / "model.safetensors"
    start = header_offset(weights, name)
    assert data["tensor_file_offset"] == start
    zero, king, last = data["rows"]
    assert (zero["token"], king["token"], king["row"], king["query"]) == (
        "<unk>",
        "king",
        ID["king"],
        "king",
    )
    assert last["padding"] is True and last["token"] is None and zero["padding"] is False
    for r in data["rows"]:
        assert r["offset_bytes"] == r["row"] * D * 4
        assert r["file"] == "model.safetensors"
        assert r["file_offset"] == start + r["offset_bytes"]
        assert read_at(weights, r["file_offset"], D * 4) == torch_row_bytes(weights, name, r["row"])
        assert r["check"] is True
    assert data["check"]["all_equal"] is True and data["check"]["rows_checked"] == 3
    assert data["check"]["method"].startswith("safetensors.safe_open")


def test_bfloat16_rows(cli, tiny, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bf16"
    shutil.copytree(tiny("llama-untied"), folder)
    weights = folder / "model.safetensors"
    save_file(
        {k: v.to(torch.bfloat16) for k, v in load_file(weights).items()},
        weights,
        metadata={"format": "pt"},
    )
    for matrix, name in (("input", "model.embed_tokens.weight"), ("output", "lm_head.weight")):
        data = cli.json("addr", folder, "42", "queen", "--matrix", matrix)
        assert data["tensor"] == name and data["dtype"] == "bfloat16" and data["element_size"] == 2
        start = header_offset(weights, name)
        for r in data["rows"]:
            assert r["offset_bytes"] == r["row"] * D * 2
            assert r["file_offset"] == start + r["row"] * D * 2
            assert read_at(weights, r["file_offset"], D * 2) == torch_row_bytes(
                weights, name, r["row"]
            )
            assert r["check"] is True


def test_sharded_rows(cli, tiny):
    folder = tiny("llama-untied", max_shard_size="20KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    for matrix, name in (("input", "model.embed_tokens.weight"), ("output", "lm_head.weight")):
        shard = index["weight_map"][name]
        data = cli.json("addr", folder, "7", "--matrix", matrix)
        (row,) = data["rows"]
        assert data["file"] == row["file"] == shard
        assert row["file_offset"] == header_offset(folder / shard, name) + 7 * D * 4
        assert read_at(folder / shard, row["file_offset"], D * 4) == torch_row_bytes(
            folder / shard, name, 7
        )
        assert row["check"] is True
    assert len(set(index["weight_map"].values())) > 1


def test_gguf_quantised_rows(cli, smollm2):
    data = cli.json("addr", smollm2, "42", " king", "--tokens", "16384")
    ref = smol_table(smollm2)
    assert ref.qtype == "Q8_0" and data["dtype"] == "Q8_0"
    assert data["shape"] == [49152, 576] and data["block"] == [32, 34]
    assert data["row_bytes"] == 576 // 32 * 34 == 612 and data["element_size"] == 34 / 32
    assert data["tensor_file_offset"] == ref.data_offset
    _, king = data["rows"]
    assert king["row"] == 4197 and king["token"] == " king" and ref.tokens[4197] == "Ġking"
    for r in data["rows"]:
        assert r["offset_bytes"] == r["row"] * 612
        assert r["file_offset"] == ref.data_offset + r["row"] * 612
        raw = read_at(smollm2, r["file_offset"], 612)
        assert raw == ref.raw[r["row"]].tobytes()
        import numpy as np
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        row = dequantize(np.frombuffer(raw, dtype=np.uint8), GGMLQuantizationType.Q8_0)
        assert np.array_equal(row, ref.rows[r["row"]])
        assert r["check"] is True
    assert data["check"]["method"] == "gguf.GGUFReader + gguf.quants.dequantize"
    assert data["costs"] == {
        "lookup_bytes_per_token": 612,
        "onehot_ops_per_token": 2 * 49152 * 576,
        "tokens": 16384,
        "batch_bytes": 16384 * 612,
        "batch_onehot_ops": 16384 * 2 * 49152 * 576,
    }


def _sparse_table(folder: Path, config: str, dtype: str, shape: list[int]) -> Path:
    """A checkpoint of one [V, d] table, its data a sparse hole: headers are all addr reads."""
    write_config(folder, json.loads((CONFIGS / config).read_text()) if config else {})
    nbytes = shape[0] * shape[1] * 2
    header = json.dumps(
        {"model.embed_tokens.weight": {"dtype": dtype, "shape": shape, "data_offsets": [0, nbytes]}}
    ).encode()
    path = folder / "model.safetensors"
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header)
        fh.truncate(8 + len(header) + nbytes)
    return path


def test_qwen3_arithmetic_of_the_seeds(cli, tmp_path):
    """REFERENCE.md: row 42 of [151936, 1024] bf16 is 86016 bytes in; one-hot 2·V·d ≈ 311 M."""
    folder = tmp_path / "qwen3"
    weights = _sparse_table(folder, "Qwen3-0.6B.json", "BF16", [151936, 1024])
    result = cli("addr", folder, "42", "151935", "--tp", "4", "--no-check", "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert "tokens are not shown" in result.stderr  # no tokenizer.json in this folder
    assert data["stride"] == [1024, 1] and data["element_size"] == 2 and data["row_bytes"] == 2048
    assert data["table_bytes"] == 151936 * 1024 * 2
    row42, last = data["rows"]
    assert row42["offset_bytes"] == 86016 and row42["token"] is None
    assert row42["file_offset"] == header_offset(weights, "model.embed_tokens.weight") + 86016
    assert data["costs"]["onehot_ops_per_token"] == 311_164_928
    assert data["check"] == {
        "method": None,
        "rows_checked": 0,
        "all_equal": None,
        "skipped": "--no-check",
    }
    # vLLM: 151936 is a multiple of 64 already; four ranks of 37984 rows each.
    assert data["tp"] == {
        "size": 4,
        "pad_to": 64,
        "padded_rows": 151936,
        "rows_per_rank": 37984,
        "shard_bytes": 37984 * 2048,
    }
    assert row42["tp"] == {"rank": 0, "local_row": 42, "local_offset_bytes": 86016}
    assert last["tp"] == {"rank": 3, "local_row": 37983, "local_offset_bytes": 37983 * 2048}
    # Seed 002's budget: d = 4096 in fp16 is 8 KiB a row; 16384 tokens read at most 128 MiB.
    wide = tmp_path / "wide"
    _sparse_table(wide, "", "F16", [1000, 4096])
    costs = cli.json("addr", wide, "0", "--tokens", "16384", "--no-check")["costs"]
    assert costs["lookup_bytes_per_token"] == 8 * 1024 and costs["batch_bytes"] == 128 * 2**20


def test_tp_with_vllm_padding(cli, tiny):
    folder = tiny("llama-tied")
    data = cli.json("addr", folder, "0", "63", "64", "71", "--tp", "2", "--no-check")
    # V = 72 pads to 128: rank 0 holds rows 0..63, rank 1 rows 64..127 (64..71 real).
    assert data["tp"]["padded_rows"] == 128 and data["tp"]["rows_per_rank"] == 64
    assert [(r["tp"]["rank"], r["tp"]["local_row"]) for r in data["rows"]] == [
        (0, 0),
        (0, 63),
        (1, 0),
        (1, 7),
    ]
    assert data["rows"][3]["tp"]["local_offset_bytes"] == 7 * D * 4


def test_text_table(cli, tiny):
    out = cli("addr", tiny("llama-tied"), "king", "--tp", "2", "--tokens", "10")
    assert out.exit_code == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "'king'" in text and "stride (32, 1)" in text and "equal" in text
    assert "2·V·d = 4,608" in text and "10 tokens read at most 1,280 bytes" in text
    assert "VocabParallelEmbedding" in text


def test_no_torch_or_transformers(tiny, smollm2):
    code = (
        "import sys, json\n"
        "from typer.testing import CliRunner\n"
        "from embedlens.cli import app\n"
        f"for model in ({str(tiny('llama-tied'))!r}, {str(smollm2)!r}):\n"
        "    r = CliRunner().invoke(app, ['addr', model, '42', '--json'])\n"
        "    assert r.exit_code == 0, r.output\n"
        "    assert json.loads(r.stdout)['check']['all_equal'] is True\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("args", "message", "code"),
    [
        (["72"], "row 72 is out of range: the table has 72 rows", 2),
        (["--", "-1"], "row -1 is negative", 2),
        ([""], "empty ROW", 2),
        (["xyzzy"], "'xyzzy' is not in the vocabulary", 2),
        (["0", "--tp", "3"], "--tp 3 does not divide the padded vocabulary", 2),
        (["0", "--tp", "0"], "--tp must be at least 1", 2),
        (["0", "--tokens", "0"], "--tokens must be at least 1", 2),
        (["0", "--matrix", "middle"], "'middle' is not one of 'input', 'output'", 2),
    ],
)
def test_bad_input(cli, tiny, args, message, code):
    err = cli.fails("addr", tiny("llama-tied"), *args, code=code)
    assert message in err


def test_missing_row_and_corrupt_file(cli, tiny, tmp_path):
    assert "Missing argument" in cli.fails("addr", tiny("llama-tied"), code=2)
    folder = tmp_path / "m"
    shutil.copytree(tiny("llama-tied"), folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert "is truncated" in cli.fails("addr", folder, "0", code=1)
    assert TOKENIZER_LEN < VOCAB


def test_row_ids_read_only_their_tokens(cli, smollm2, tiny, tmp_path):
    """Rows given as ids show the tokens the whole tokenizer shows, and the tokenizer's size;
    a broken token is named when a row asked for is that token, and left unread otherwise."""
    from embedlens.io.gguf import read_gguf_header
    from embedlens.model.tokenizer import vocab_from_gguf
    from tests.badinputs import MAKERS

    whole = vocab_from_gguf(read_gguf_header(smollm2))
    data = cli.json("addr", smollm2, "0", "42", "4197", "49151")
    assert data["tokenizer_size"] == whole.size == 49152
    assert [r["token"] for r in data["rows"]] == [whole.text(i) for i in (0, 42, 4197, 49151)]
    assert data["rows"][2]["token"] == " king"
    broken = MAKERS["gguf-token-not-utf8"](tmp_path, tiny, smollm2)
    err = cli.fails("addr", broken, "3", "7", code=1)
    assert "tokenizer.ggml.tokens[7] b'\\xff\\xfe" in err and "is not valid UTF-8" in err
    assert cli.json("addr", broken, "3")["rows"][0]["token"] == whole.text(3)


def test_gguf_check_finds_the_row_on_its_own(smollm2):
    """The read-back locates each row with gguf's reader: an entry whose offset is one row off
    is found unequal, not compared with itself."""
    from dataclasses import replace

    from embedlens.analysis.addr import gguf_check
    from embedlens.io.source import resolve
    from embedlens.model.matrix import locate

    table = locate(resolve(str(smollm2), None), "input")
    entry, header = table.entry, table.checkpoint.gguf
    assert header is not None and entry.file_offset is not None
    assert gguf_check(entry, [42, 4197], header)[1] == [True, True]
    shifted = replace(entry, file_offset=entry.file_offset + entry.row_bytes)
    assert gguf_check(shifted, [42, 4197], header)[1] == [False, False]


def test_row_ids_on_a_gguf_without_a_usable_tokenizer(cli, smollm2, tiny, tmp_path):
    """Ids need no tokenizer: the rows are addressed and a note says why tokens are not shown
    (a token's text is an error, in the bad-input suite)."""
    from tests.badinputs import MAKERS

    broken = MAKERS["gguf-no-merges"](tmp_path, tiny, smollm2)
    data = cli.json("addr", broken, "3")
    assert data["rows"][0]["token"] is None and data["check"]["all_equal"] is True
    assert any("without merges" in n for n in data["notes"])


def _byte_level_gguf(path: Path) -> tuple[Path, list[int]]:
    """A byte-level GGUF of over 256 entries (kept lazily in the header, as a real vocabulary
    is): the byte alphabet, leading-space and newline pieces, a control token, a piece stored
    as text; with the ids that show each kind."""
    from embedlens.model.tokens import byte_alphabet
    from tests.test_vocab import _write_gguf

    letters = list(byte_alphabet().values())
    extra = ["Ġk", "in", "Ġkin", "Ġking", "ĊĠ", "<|endoftext|>", "北京"]
    tokens = letters + extra
    types = [1] * len(letters) + [1, 1, 1, 1, 1, 3, 4]
    merges = ["Ġ k", "i n", "Ġk in", "Ġkin g", "Ċ Ġ"]
    _write_gguf(path, tokens, model="gpt2", merges=merges, types=types)
    shown = [tokens.index(t) for t in ("!", "Ġ", "Ċ", "Ã", "¡", *extra)]
    return path, shown


def _sentencepiece_gguf(path: Path) -> tuple[Path, list[int]]:
    """A SentencePiece GGUF ('llama', scores, no merges) and the ids that show its kinds of
    entries: unknown, control, byte pieces, '▁' alone and leading, plain characters."""
    from tests.test_vocab import _sentencepiece_vocab, _write_gguf

    tokens, scores, types = _sentencepiece_vocab()
    types[tokens.index("▁king")] = 4  # user-defined
    _write_gguf(path, tokens, model="llama", scores=scores, types=types)
    shown = [0, 1, 2, 3 + 0x20, 3 + 0x41, 3 + 0xC3, 3 + 0xE4]
    shown += [tokens.index(t) for t in ("▁", "▁king", "▁queen", "k")] + [len(tokens) - 1]
    return path, shown


def _builds_counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record each call of the builders of a whole GGUF tokenizer (calling through)."""
    from embedlens.model import gguf_vocab, gguf_words, tokenizer, tokens

    built: list[str] = []
    for name in (
        "vocab_from_gguf",
        "gguf_tokenizer",
        "byte_level_tokenizer",
        "sentencepiece_tokenizer",
    ):
        holders = [m for m in (tokenizer, gguf_vocab, tokens) if hasattr(m, name)]
        real = getattr(holders[0], name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            built.append(_name)
            return _real(*args, **kwargs)

        for holder in holders:  # where it is defined, and where it is imported by name
            monkeypatch.setattr(holder, name, counted)
    assert gguf_words.gv is gguf_vocab and gguf_words.tb is tokens
    return built


def _rows_without_the_tokenizer(
    cli: Any, path: Path, ids: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """addr on rows given as ids builds no whole tokenizer, and its report (so its JSON and its
    table) is the one the whole tokenizer gives; a row given as text builds a tokenizer of the
    pieces it can be made of, not the whole one, and gives the same report too."""
    from embedlens.analysis.addr import addr, addr_report
    from embedlens.io.gguf import read_gguf_header
    from embedlens.io.source import resolve
    from embedlens.model.matrix import locate
    from embedlens.model.tokenizer import vocab_from_gguf

    texts = [str(i) for i in ids]
    table = locate(resolve(str(path), None), "input")
    whole = vocab_from_gguf(read_gguf_header(path))
    expected = addr_report(
        str(path), table, whole, texts, tokens=None, tp=None, check=True, notes=list(table.notes)
    )
    built = _builds_counted(monkeypatch)
    assert addr(path, texts) == expected
    data = cli.json("addr", path, *texts)
    assert [r["token"] for r in data["rows"]] == [whole.text(i) for i in ids]
    assert built == []
    mixed = [texts[0], " king", "king"]
    expected = addr_report(
        str(path), table, whole, mixed, tokens=None, tp=None, check=True, notes=list(table.notes)
    )
    assert addr(path, mixed) == expected
    assert "vocab_from_gguf" not in built


@pytest.mark.parametrize("make", [_byte_level_gguf, _sentencepiece_gguf])
def test_row_ids_build_no_tokenizer(cli, tmp_path, monkeypatch, make):
    path, ids = make(tmp_path / "vocab.gguf")
    _rows_without_the_tokenizer(cli, path, ids, monkeypatch)


def test_row_ids_build_no_tokenizer_smollm2(cli, smollm2, monkeypatch):
    """SmolLM2's byte-level vocabulary: control tokens, bytes of a partial UTF-8 sequence,
    newline and space pieces, a leading-space word, the last id."""
    ids = [0, 2, 17, 111, 198, 216, 448, 4197, 49151]
    _rows_without_the_tokenizer(cli, smollm2, ids, monkeypatch)
