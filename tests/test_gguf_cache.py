"""transformers' reading of a GGUF file's config and tokenizer, kept (model/gguf_cache.py), and a
GGUF tensor read from embedlens' own header (tail_tensors.gguf_data): the same as transformers
and gguf give, without parsing the file again."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from embedlens.io.gguf import read_gguf_header
from embedlens.io.source import resolve
from embedlens.model import gguf_cache, loading
from tests.fileformats import gguf_bytes

TEXTS = ["The capital of France is", "中国的首都是", "  spaces\tand\nlines ", "<|im_start|>user"]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EMBEDLENS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("EMBEDLENS_PLAIN", raising=False)
    return tmp_path / "cache" / "gguf"


@pytest.fixture
def no_gguf_parse(monkeypatch: pytest.MonkeyPatch) -> Any:
    """While active, building a gguf.GGUFReader fails the test (the file is parsed again)."""
    import gguf

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("the GGUF file was parsed again")

    def arm() -> None:
        monkeypatch.setattr(gguf, "GGUFReader", refused)

    return arm


def _same_tokenizer(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    assert len(a) == len(b)
    assert a.name_or_path == b.name_or_path
    assert a.special_tokens_map == b.special_tokens_map
    assert a.all_special_ids == b.all_special_ids
    assert a.chat_template == b.chat_template
    ids = list(range(len(a)))
    assert a.convert_ids_to_tokens(ids) == b.convert_ids_to_tokens(ids)
    assert [a.decode([i]) for i in ids[::97]] == [b.decode([i]) for i in ids[::97]]
    for text in TEXTS:
        assert a(text)["input_ids"] == b(text)["input_ids"]
        assert (
            a(text, add_special_tokens=False)["input_ids"]
            == b(text, add_special_tokens=False)["input_ids"]
        )


@pytest.fixture(scope="module")
def built(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """SmolLM2's config and tokenizer as transformers builds them, and the cache they were kept
    in (the module's own)."""
    folder = tmp_path_factory.mktemp("kept")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EMBEDLENS_CACHE", str(folder))
        mp.delenv("EMBEDLENS_PLAIN", raising=False)
        source = resolve(str(smollm2), None)
        return loading.hf_config(source), loading.load_tokenizer(source), folder / "gguf"


def test_kept_config_and_tokenizer_are_what_transformers_built(
    smollm2, built, monkeypatch, no_gguf_parse
):
    """Read back without parsing the file, the same config and tokenizer; where this release's
    tokenizer does not survive save_pretrained (transformers 5.0), a marker and no tokenizer."""
    built_config, built_tokenizer, kept = built
    (entry,) = kept.iterdir()
    names = {p.name for p in entry.iterdir()}
    assert "config.json" in names
    kept_tokenizer = "embedlens-not-kept-tokenizer.json" not in names
    assert ("tokenizer.json" in names) == kept_tokenizer
    monkeypatch.setenv("EMBEDLENS_CACHE", str(kept.parent))
    source = resolve(str(smollm2), None)
    if kept_tokenizer:
        no_gguf_parse()
    config = loading.hf_config(source)
    tokenizer = loading.load_tokenizer(source)
    assert config.to_dict() == built_config.to_dict()
    assert config.name_or_path == built_config.name_or_path == str(smollm2.parent.resolve())
    _same_tokenizer(tokenizer, built_tokenizer)


def test_what_reads_back_otherwise_is_not_kept(smollm2, built, cache, monkeypatch):
    calls: list[str] = []

    def differs(built: Any, back: Any, name: str) -> bool:
        calls.append(name)
        return False

    monkeypatch.setattr(gguf_cache, "_same", differs)
    source = resolve(str(smollm2), None)
    header = read_gguf_header(smollm2)
    folder = gguf_cache.entry(header)
    assert folder is not None
    gguf_cache.store(folder, built[1], "tokenizer.json")
    gguf_cache.store(folder, built[1], "tokenizer.json")
    assert calls == ["tokenizer.json"]  # the marker stops a second try
    assert sorted(p.name for p in folder.iterdir()) == ["embedlens-not-kept-tokenizer.json"]
    assert gguf_cache.load(folder, "tokenizer.json") is None
    _same_tokenizer(loading.load_tokenizer(source), built[1])


def test_a_damaged_entry_is_built_again(smollm2, built, cache):
    import shutil

    (entry,) = built[2].iterdir()
    shutil.copytree(entry, cache / entry.name)
    kept = [p for p in (cache / entry.name).iterdir() if not p.name.startswith("embedlens-")]
    damaged = [p for p in kept if p.name.endswith(".json")]
    assert "config.json" in {p.name for p in damaged}
    for path in damaged:
        path.write_text("{not json", encoding="utf-8")
    source = resolve(str(smollm2), None)
    _same_tokenizer(loading.load_tokenizer(source), built[1])
    assert loading.hf_config(source).to_dict() == built[0].to_dict()
    for path in damaged:
        assert path.read_bytes() == (entry / path.name).read_bytes(), path.name


def test_an_unwritable_cache_is_left_alone(smollm2, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("", encoding="utf-8")
    monkeypatch.setenv("EMBEDLENS_CACHE", str(blocker))
    source = resolve(str(smollm2), None)
    assert loading.hf_config(source).model_type == "llama"
    assert loading.load_tokenizer(source).vocab_size == 49152


def test_the_public_path_keeps_nothing(smollm2, cache, monkeypatch):
    monkeypatch.setenv("EMBEDLENS_PLAIN", "1")
    loading.hf_config(resolve(str(smollm2), None))
    assert not cache.exists()


def test_the_lens_gives_the_same_bytes_from_a_kept_entry(smollm2, cli, tmp_path):
    """Cold (transformers builds, then the entry is written) and warm (read back): one JSON."""
    env = {"EMBEDLENS_CACHE": str(tmp_path / "cache")}
    cold = cli("lens", smollm2, "The capital of France is", "--json", env=env).stdout
    assert any((tmp_path / "cache" / "gguf").iterdir())
    warm = cli("lens", smollm2, "The capital of France is", "--json", env=env).stdout
    assert warm == cold


def test_the_key_is_the_metadata_and_tensor_table_not_the_data(tmp_path):
    """Another metadata value or tensor shape: another entry; other tensor bytes: the same."""

    def write(name: str, arch: str, rows: int, fill: int = 0) -> Path:
        blob = bytearray(gguf_bytes([("general.architecture", 8, arch)], [("t", (4, rows), 0)]))
        if fill:
            blob[-16:] = bytes([fill]) * 16
        path = tmp_path / name
        path.write_bytes(bytes(blob))
        return path

    def key(path: Path) -> str:
        folder = gguf_cache.entry(read_gguf_header(path))
        assert folder is not None
        return folder.name

    base = key(write("a.gguf", "llama", 8))
    assert key(write("b.gguf", "llama", 8, fill=7)) == base
    assert key(write("c.gguf", "qwen2", 8)) != base
    assert key(write("d.gguf", "llama", 16)) != base


TYPES = [0, 1, 2, 3, 8, 10, 12, 14, 24, 25, 26, 27, 28, 30]
"""F32, F16, Q4_0, Q4_1, Q8_0, Q2_K, Q4_K, Q6_K, I8, I16, I32, I64, F64, BF16."""


def test_a_tensor_read_from_the_header_is_what_gguf_s_reader_presents(tmp_path, smollm2):
    import gguf
    import numpy as np

    from embedlens.compat.transformers.tail_tensors import gguf_data

    made = tmp_path / "types.gguf"
    tensors = [(f"t{t}", (256, 3), t) for t in TYPES]
    made.write_bytes(gguf_bytes([("general.architecture", 8, "llama")], tensors))
    for path in (made, smollm2):
        header = read_gguf_header(path)
        reader = gguf.GGUFReader(str(path))
        assert len(reader.tensors) == len(header.tensors)
        for t in reader.tensors:
            ours = gguf_data(path, header.tensors[t.name])
            assert (ours.dtype, ours.shape) == (t.data.dtype, t.data.shape), t.name
            assert np.asarray(ours).tobytes() == np.asarray(t.data).tobytes(), t.name
    assert os.path.getsize(made) > 0
