"""Every command's function takes MODEL as a `pathlib.Path` as well as text, with the same report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import embedlens

CALLS: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "params": ((), {}),
    "tied": ((), {}),
    "neighbors": ((["king"],), {"top_k": 3}),
    "addr": (([42],), {}),
    "vocab": ((), {}),
    "lens": (("Hello world",), {"top_k": 2}),
    "lens_prompts": ((["Hello world", "the king"],), {"top_k": 2}),
    "lens_parity": (("Hello world",), {"against_dtype": "float32"}),
}


def test_every_command_is_checked():
    commands = {n for n in embedlens.__all__ if n.islower() and not n.startswith("_")}
    # tune writes a folder: its own test below; lens_states reads one: tests/test_states.py;
    # lens_text reads a text file (tests/test_lens_text.py runs it on Paths)
    assert {*CALLS, "tune", "lens_states", "lens_text"} == commands


def test_tune_takes_paths_for_the_model_the_data_and_the_folder(tiny, tmp_path):
    from tests.test_tune import words_file

    folder = tiny("llama-tied")
    data = words_file(tmp_path / "words.txt")
    small = {"tokens": 512, "eval_tokens": 128, "method": "affine"}
    as_paths = embedlens.tune(folder, data, tmp_path / "a", **small).to_dict()
    as_text = embedlens.tune(str(folder), str(data), str(tmp_path / "b"), **small).to_dict()
    assert as_paths.pop("out") == str(tmp_path / "a")
    assert as_text.pop("out") == str(tmp_path / "b")
    assert as_paths == as_text
    assert as_paths["model"] == str(folder)
    a, b = (tmp_path / x / "params.safetensors" for x in "ab")
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("command", sorted(CALLS))
def test_a_path_gives_what_its_text_gives(command, tiny):
    folder = tiny("llama-tied")
    assert isinstance(folder, Path)
    args, options = CALLS[command]
    fn = getattr(embedlens, command)
    from_path = fn(folder, *args, **options).to_dict()
    from_text = fn(str(folder), *args, **options).to_dict()
    assert from_path == from_text
    assert from_path["model"] == str(folder)


def test_vocab_takes_paths_for_the_other_vocabulary_and_tokenizer(tiny):
    folder = tiny("llama-tied")
    as_paths = embedlens.vocab(folder, against=folder, tokenizer=folder / "tokenizer.json")
    as_text = embedlens.vocab(
        str(folder), against=str(folder), tokenizer=str(folder / "tokenizer.json")
    )
    assert as_paths.to_dict() == as_text.to_dict()
    assert as_paths.against is not None and as_paths.against.identical
    assert as_paths.tokenizer == str(folder / "tokenizer.json")
