"""Loading goes down once: each command reads each file's header, and config.json, once.

A source is resolved, its headers and config read once into one object (`model.files`), and the
tokenizer, the memory check and the model are built from it. Counted here: embedlens' own parses
of a safetensors or GGUF header (`io.checkpoint.parse_safetensors_header`, `io.gguf`'s parser),
and embedlens' own opens of config.json for reading; transformers reads config.json once more
when it builds the config object, and a GGUF file once more for the weights (its own reader):
those are not embedlens' reads and are not counted.
"""

from __future__ import annotations

import builtins
import importlib.util
import io
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import embedlens
from embedlens.compat.transformers import installed_transformers, release_key
from tests.conftest import READS_GGUF_AS_FILE
from tests.test_tune import words_file
from tests.tiny_gguf import byte_level_vocabulary, write_tiny_gguf
from tests.walk import package_module, package_prefixes

PREFIXES = package_prefixes()
"""The installed package's folder: its files are embedlens' own, wherever the clone and venv lie."""
_SPEC = importlib.util.find_spec("transformers")
assert _SPEC is not None and _SPEC.submodule_search_locations
TRANSFORMERS = package_prefixes(Path(_SPEC.submodule_search_locations[0]))
"""transformers' own folder, found from the installed package as embedlens' is."""


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Counter[tuple[str, str]]:
    """(what, file name) -> how many times embedlens read it."""
    from embedlens.io import checkpoint, gguf

    counted: Counter[tuple[str, str]] = Counter()
    safetensors_parse = checkpoint.parse_safetensors_header
    gguf_parse = gguf._parse
    real_open = io.open

    def safetensors_counted(raw: bytes, name: str, **kwargs: Any) -> Any:
        counted["header", name] += 1
        return safetensors_parse(raw, name, **kwargs)

    def gguf_counted(path: Path, *args: Any, **kwargs: Any) -> Any:
        counted["header", Path(path).name] += 1
        return gguf_parse(path, *args, **kwargs)

    def open_counted(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        config = isinstance(file, (str, Path)) and Path(file).name == "config.json"
        if config and "r" in mode and _embedlens_caller():
            counted["config", "config.json"] += 1
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "parse_safetensors_header", safetensors_counted)
    monkeypatch.setattr(gguf, "_parse", gguf_counted)
    monkeypatch.setattr(io, "open", open_counted)
    monkeypatch.setattr(builtins, "open", open_counted)
    return counted


def _embedlens_caller() -> bool:
    """Whether the nearest frame of embedlens or transformers below the open is embedlens'."""
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if package_module(name, PREFIXES) is not None:
            return True
        if name.startswith(TRANSFORMERS):
            return False
        frame = frame.f_back
    return False


def _once(counted: Counter[tuple[str, str]], *expected: tuple[str, str]) -> None:
    assert dict(counted) == dict.fromkeys(expected, 1), dict(counted)


COMMANDS: dict[str, Callable[[Path, Path], Any]] = {
    "lens": lambda model, tmp: embedlens.lens(model, "the king"),
    "tune": lambda model, tmp: embedlens.tune(
        model, words_file(tmp / "w.txt"), tmp / "lens", tokens=512, eval_tokens=128, steps=1
    ),
    "vocab": lambda model, tmp: embedlens.vocab(model),
    "params": lambda model, tmp: embedlens.params(model),
    "tied": lambda model, tmp: embedlens.tied(model),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_folder_is_read_once(tiny, tmp_path, reads, command):
    COMMANDS[command](tiny("llama-tied"), tmp_path)
    _once(reads, ("header", "model.safetensors"), ("config", "config.json"))


def test_a_sharded_folder_reads_each_shard_once(tiny, reads):
    folder = tiny("llama-untied", max_shard_size="20KB")
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 1
    embedlens.lens(folder, "the king")
    _once(reads, *(("header", s) for s in shards), ("config", "config.json"))


OLDER = release_key(installed_transformers() or "0") < READS_GGUF_AS_FILE
"""An older transformers reads the tiny GGUF's prompt otherwise than the file: the lens refuses
it (tests/test_prompt_tokens.py)."""


@pytest.mark.parametrize(
    "command",
    [
        pytest.param("lens", marks=pytest.mark.skipif(OLDER, reason="refused on this release")),
        "vocab",
        "params",
    ],
)
def test_a_gguf_file_is_read_once(tmp_path_factory, tmp_path, reads, command):
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "smol.gguf", "llama",
                           byte_level_vocabulary())  # fmt: skip
    reads.clear()
    COMMANDS[command](path, tmp_path)
    _once(reads, ("header", "smol.gguf"))
