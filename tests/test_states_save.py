"""lens --save-states beyond one prompt on one device: --prompts (a folder, a file a prompt),
--device-map, and --prompts under torchrun (rank 0 writes every prompt's file)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_states import SOURCE_FIELDS

PROMPTS = ["the king of France is", "a cat and a dog", "three queens"]


def _figures(data: dict[str, object]) -> str:
    return json.dumps({k: v for k, v in data.items() if k not in SOURCE_FIELDS}, sort_keys=True)


def _prompts(path: Path) -> Path:
    path.write_text("".join(p + "\n" for p in PROMPTS), encoding="utf-8")
    return path


def test_prompts_save_a_file_a_prompt_that_decodes_to_the_lens(tiny, cli, tmp_path):
    folder = tiny("llama-tied")
    out = tmp_path / "states"
    result = cli("lens", folder, "--prompts", _prompts(tmp_path / "p.txt"), "--json",
                 "--save-states", out)  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "000001.safetensors", "000002.safetensors", "000003.safetensors",
    ]  # fmt: skip
    assert f"wrote each prompt's states to {out}" in result.stderr
    for line, prompt in enumerate(PROMPTS, start=1):
        saved = out / f"{line:06d}.safetensors"
        direct = cli.json("lens", folder, prompt, "-k", "3")
        decoded = cli.json("lens", folder, "--states", saved, "-k", "3")
        assert _figures(decoded) == _figures(direct)
        meta = decoded["states"]["metadata"]
        assert meta["prompt"] == prompt and meta["line"] == str(line)
        assert decoded["check"]["ok"] is True
        alone = tmp_path / f"alone{line}.safetensors"
        assert cli("lens", folder, prompt, "--save-states", alone).exit_code == 0
        assert _tensors(saved) == _tensors(alone)  # the same states as a single run's


def _tensors(path: Path) -> dict[str, bytes]:
    from safetensors.torch import load_file

    return {k: v.numpy().tobytes() for k, v in load_file(str(path)).items()}


def test_device_map_saves_what_one_device_saves(tiny, cli, tmp_path):
    folder = tiny("llama-tied")
    one, mapped = tmp_path / "one.st", tmp_path / "mapped.st"
    assert cli("lens", folder, PROMPTS[0], "--save-states", one).exit_code == 0
    result = cli("lens", folder, PROMPTS[0], "--device-map", "auto", "--save-states", mapped)
    assert result.exit_code == 0, result.stderr
    assert _tensors(mapped) == _tensors(one)


@pytest.mark.slow
def test_prompts_under_torchrun_rank_0_writes_every_file(tiny, cli, tmp_path):
    from tests.test_dist import prompts_file, torchrun

    folder = tiny("llama-tied")
    path = prompts_file(tmp_path / "p.jsonl")  # three windows: rank 1 runs one
    args = ["lens", folder, "--prompts", path, "--json", "--skip-bad"]
    alone = cli(*args, "--save-states", tmp_path / "one")
    assert alone.exit_code == 0, alone.stderr
    two = torchrun(*args, "--save-states", tmp_path / "two")
    assert two.returncode == 0, two.stderr
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert len(names) == 148 and names == sorted(p.name for p in (tmp_path / "two").iterdir())
    for name in names[::7] + names[-3:]:  # rank 1's window among them (lines 130 and on)
        assert _tensors(tmp_path / "two" / name) == _tensors(tmp_path / "one" / name)
