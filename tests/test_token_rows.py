"""A tokenizer that does not belong to the model: every id fed to the model must have a row in its
embedding, checked before any forward pass (and, from files, before the weights are loaded):
one `error:` naming the tokenizer's size and the model's rows, exit 1, never an IndexError."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.models import VOCAB

SIZE = 49_152
"""SmolLM2's vocabulary size: the tokenizer given to the tiny model of VOCAB rows."""
HIGH = SIZE - 1
"""The id 'king' gets in that tokenizer."""


@pytest.fixture
def wide(tiny, tmp_path) -> Path:
    """The tiny Llama with a tokenizer.json of 49,152 ids, 'king' the last of them."""
    folder = tmp_path / "wide"
    shutil.copytree(tiny("llama-tied"), folder)
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab: dict[str, int] = data["model"]["vocab"]
    for i in range(len(vocab), SIZE):
        vocab[f"w{i}"] = i
    vocab["king"], vocab[f"w{HIGH}"] = HIGH, vocab["king"]
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return folder


def _says(err: str, folder: Path) -> None:
    assert err.startswith(
        f"error: the tokenizer has {SIZE:,} ids and gives id {HIGH:,}, but the embedding of '"
    ), err
    assert f"'{folder}' has {VOCAB:,} rows: the tokenizer and the model do not belong" in err
    assert "internal error" not in err and "IndexError" not in err


CASES: dict[str, Any] = {
    "prompt": lambda tmp: ["the king"],
    "target": lambda tmp: ["the", "--target", "king"],
    "chat": lambda tmp: ["the", "--chat", "the king"],
    "prompts": lambda tmp: ["--prompts", _file(tmp / "p.txt", "the queen\nthe king\n")],
    "text": lambda tmp: [
        "--text",
        _file(tmp / "t.txt", "the queen and the king " * 20),
        "--ctx",
        "16",
    ],
}


def _file(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_id_without_a_row_is_refused(cli, wide, tmp_path, monkeypatch, case):
    from embedlens.model import loading

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(loading, "load_model", never)
    err = cli.fails("lens", wide, *CASES[case](tmp_path), code=1)
    _says(err, wide)


EARLY = ("prompt", "target", "prompts")
"""The cases whose texts the run encodes as they are: told from tokenizer.json and the headers."""


@pytest.mark.parametrize("case", EARLY)
def test_refused_before_torch_or_transformers_is_imported(wide, tmp_path, case):
    """The folder's tokenizer.json read by the `tokenizers` library and the checkpoint's header
    tell it: the same error, with neither torch nor transformers imported (the command takes
    about half a second; no bound on time here, the machine may be busy)."""
    import os
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root, "HF_HUB_OFFLINE": "1"}
    argv = ["lens", str(wide), *map(str, CASES[case](tmp_path))]
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "embedlens", *argv],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    said = [x for x in result.stderr.splitlines() if not x.startswith("import time:")]
    imported = {
        x.split("|")[-1].strip().split(".")[0]
        for x in result.stderr.splitlines()
        if x.startswith("import time:")
    }
    assert result.returncode == 1, result.stderr[-2000:]
    _says(said[0], wide)
    assert imported & {"torch", "transformers"} == set()
    assert "tokenizers" in imported  # the check ran, from tokenizer.json


@pytest.mark.parametrize("side", ["a", "b"])
def test_either_side_of_against_is_refused(cli, tiny, wide, tmp_path, side):
    """B reads A's ids: where the two tokenizers differ, the pair is refused before either
    model is opened, by the comparison of the vocabularies (which comes first), never by an
    IndexError inside either model."""
    a, b = (wide, tiny("llama-tied")) if side == "a" else (tiny("llama-tied"), wide)
    err = cli.fails("lens", a, "the king", "--against", b, code=1)
    assert f"error: '{b}' does not share the vocabulary of '{a}'" in err, err
    assert "internal error" not in err and "IndexError" not in err


def test_against_with_the_same_wide_tokenizer_is_refused(cli, wide, tmp_path, monkeypatch):
    """Two models with the same tokenizer pass the comparison of vocabularies: the ids are then
    refused against the embeddings' rows (A's named first), before any weight is loaded."""
    from embedlens.model import loading

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(loading, "load_model", never)
    twin = tmp_path / "twin"
    shutil.copytree(wide, twin)
    for args in (["the king"], ["--prompts", _file(tmp_path / "p.txt", "the queen\nthe king\n")]):
        err = cli.fails("lens", wide, *args, "--against", twin, code=1)
        _says(err, wide)


def test_a_loaded_model_with_another_tokenizer_is_refused(tiny, wide):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import embedlens
    from embedlens.errors import ConfigError

    model = AutoModelForCausalLM.from_pretrained(tiny("llama-tied"))
    tokenizer = AutoTokenizer.from_pretrained(wide)
    with pytest.raises(ConfigError, match="the tokenizer and the model do not belong together"):
        embedlens.lens(model, "the king", tokenizer=tokenizer)


def test_ids_below_the_rows_run(cli, wide):
    """The same wide tokenizer runs where every id of the prompt has a row."""
    data = cli.json("lens", wide, "the queen")
    assert data["prompt"] == "the queen"
