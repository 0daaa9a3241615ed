"""A config that contradicts the checkpoint's shapes: refused before transformers builds the
model from it (which would allocate the config's sizes), reported as a disagreement by the
header commands, and counted by the memory pre-flight at the larger of the two."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from embedlens.io.source import resolve
from embedlens.model import preflight
from tests.models import VOCAB


def _edited(tmp_path: Path, folder: Path, **changes: object) -> Path:
    out = tmp_path / "edited"
    shutil.copytree(folder, out)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


CASES = {
    "vocabulary": (
        {"vocab_size": 10_000_000},
        "vocabulary size (embedding rows) 10,000,000",
        VOCAB,
    ),
    "width": ({"hidden_size": 64}, "width 64", 32),
    "layers": ({"num_hidden_layers": 6}, "layers 6", 3),
}
LOADS = {"lens": ["the king"], "params": ["--load"], "tied": ["--load"]}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("command", sorted(LOADS))
def test_a_config_the_weights_contradict_is_refused_before_loading(
    cli, tiny, tmp_path, case, command
):
    changes, said, stored = CASES[case]
    folder = _edited(tmp_path, tiny("llama-tied"), **changes)
    # a memory limit the config's sizes would pass only if nothing were allocated from them
    err = cli.fails(
        command, folder, *LOADS[command], code=1, env={"EMBEDLENS_MEMORY_LIMIT": "1GiB"}
    )
    assert f"says {said}, but the checkpoint stores {stored:,}" in err, err


@pytest.mark.parametrize("command", ["params", "tied"])
def test_header_commands_say_the_config_disagrees(cli, tiny, tmp_path, command):
    folder = _edited(tmp_path, tiny("llama-tied"), vocab_size=10_000_000)
    result = cli(command, folder)
    assert result.exit_code == 0, result.stderr
    assert (
        "note: the config and the checkpoint disagree: the config says vocabulary size "
        "(embedding rows) 10,000,000, the checkpoint stores 72; the figures here are the "
        "checkpoint's" in " ".join(result.stderr.split())
    ), result.stderr
    data = cli.json(command, folder)
    if command == "params":
        assert data["vocab_size"] == VOCAB
        assert f"V = {VOCAB}," in result.stdout
    else:
        assert data["shape"][0] == VOCAB
    plain = cli(command, tiny("llama-tied"))
    assert "disagree" not in plain.stderr


def test_params_counts_the_blocks_stored_when_the_config_says_more(cli, tiny, tmp_path):
    folder = _edited(tmp_path, tiny("llama-untied"), num_hidden_layers=6)
    assert cli.json("params", folder)["num_layers"] == 3


def test_the_estimate_covers_what_the_config_makes_transformers_allocate(tiny, tmp_path):
    stored = preflight.estimate(resolve(str(tiny("llama-tied"))), "float32")
    edited = _edited(tmp_path, tiny("llama-tied"), vocab_size=10_000_000)
    est = preflight.estimate(resolve(str(edited)), "float32")
    assert stored is not None and est is not None
    assert est.weights - stored.weights == (10_000_000 - VOCAB) * 32 * 4
    assert est.largest == 10_000_000 * 32 * 4


def _patch_u32(data: bytearray, key: bytes, old: int, new: int) -> None:
    """Rewrite a UINT32 metadata value in place (key, type 4, value)."""
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    assert struct.unpack_from("<II", data, at) == (4, old)
    struct.pack_into("<I", data, at + 4, new)


@pytest.mark.parametrize(
    ("key", "old", "new", "said"),
    [
        (b"llama.block_count", 30, 40, "layers 40, but the checkpoint stores 30"),
        (b"llama.embedding_length", 576, 640, "width 640, but the checkpoint stores 576"),
    ],
)
def test_a_gguf_whose_metadata_disagrees_is_refused(cli, smollm2, tmp_path, key, old, new, said):
    data = bytearray(smollm2.read_bytes())
    _patch_u32(data, key, old, new)
    path = tmp_path / "edited.gguf"
    path.write_bytes(data)
    err = cli.fails("lens", path, "The capital of France is", code=1)
    assert f"error: the GGUF metadata of '{path}' says {said}" in err, err
