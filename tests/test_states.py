"""lens --states: hidden states saved by `lens --save-states`, or written in vLLM's layout from
plain transformers, decode to the lens's own figures, reading only the model's tail."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.models import FAMILIES

PROMPT = "the king of France is"
SMOL_PROMPT = "The capital of France is"
SOURCE_FIELDS = {"check", "states", "tuned"}
"""Fields of a states report that name the source and the check (the rest match `lens`)."""


def _same_figures(model_json: dict[str, Any], states_json: dict[str, Any]) -> None:
    """Byte-identical JSON but for the fields naming the source and the check."""
    assert states_json["tuned"] is None or "tuned" in model_json
    mine = {k: v for k, v in model_json.items() if k not in SOURCE_FIELDS}
    theirs = {k: v for k, v in states_json.items() if k not in SOURCE_FIELDS}
    assert json.dumps(theirs, sort_keys=True) == json.dumps(mine, sort_keys=True)


FLOAT_TOLERANCE = 1e-5
"""How far a figure of states plain transformers computed may lie from the lens's own run of the
same model: two forward passes through different kernels (the test's plain forward, the lens's
engine) round float32 differently on some CPUs (an AMD EPYC moved log-probs by 3e-8)."""


def _close_figures(model_json: dict[str, Any], states_json: dict[str, Any]) -> None:
    """`_same_figures` for states another program computed: every id, token and field the same,
    every float within FLOAT_TOLERANCE."""
    mine = {k: v for k, v in model_json.items() if k not in SOURCE_FIELDS}
    theirs = {k: v for k, v in states_json.items() if k not in SOURCE_FIELDS}
    _close(mine, theirs, "")


def _close(mine: Any, theirs: Any, where: str) -> None:
    if isinstance(mine, dict):
        assert isinstance(theirs, dict) and sorted(mine) == sorted(theirs), where
        for key, value in mine.items():
            _close(value, theirs[key], f"{where}.{key}")
    elif isinstance(mine, list):
        assert isinstance(theirs, list) and len(mine) == len(theirs), where
        for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            _close(a, b, f"{where}[{i}]")
    elif isinstance(mine, float) and not isinstance(theirs, bool):
        assert isinstance(theirs, (int, float)), where
        assert abs(mine - theirs) <= FLOAT_TOLERANCE, (where, mine, theirs)
    else:
        assert mine == theirs and type(mine) is type(theirs), (where, mine, theirs)


def vllm_file(folder: Path, path: Path, prompt: str, layers: list[int]) -> None:
    """States in vLLM's layout (its hidden-states connector's two tensors, no metadata), from
    plain transformers' output_hidden_states: [T, len(layers), H], layer i the input of block i."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(folder)(prompt)["input_ids"]
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    states = torch.stack([out.hidden_states[layer][0] for layer in layers], dim=1)
    save_file({"hidden_states": states.contiguous(), "token_ids": torch.tensor(ids)}, str(path))


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("position", ["-1", "all"])
def test_saved_states_decode_to_the_lens_figures(family, position, tiny, cli, tmp_path):
    folder = tiny(family)
    saved = tmp_path / "states.safetensors"
    args = ["--position", position, "--target", "king", "-k", "3"]
    direct = cli.json("lens", folder, PROMPT, *args, "--save-states", saved)
    decoded = cli.json("lens", folder, "--states", saved, *args)
    if position == "all":  # the file holds the model's own logits at the last position only,
        # as a run of that position gives them: the grid's last row is the decoding of block L's
        # output, within the check's reach of the model's logits at every position
        last = direct["num_layers"]
        for data in (direct, decoded):
            row = next(r for r in data["grid"] if r["layer"] == last)
            data["_cells"], row["cells"] = row["cells"], []
            data["_cells"] += data["layers"].pop()["top"]
        for mine, theirs in zip(direct.pop("_cells"), decoded.pop("_cells"), strict=True):
            assert mine["id"] == theirs["id"]
            assert abs(mine["logprob"] - theirs["logprob"]) <= 1e-4
    _same_figures(direct, decoded)
    states = decoded["states"]
    assert states["layout"] == "embedlens" and states["checked"] is True
    assert decoded["check"]["ok"] is True and decoded["check"]["max_abs_logit_diff"] <= 1e-3
    assert states["layers"] == list(range(direct["num_layers"] + 1))
    meta = states["metadata"]
    assert meta["model"] == str(folder) and meta["dtype"] == "float32" and meta["prompt"] == PROMPT
    assert "embedding output" in meta["layer_0"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_vllm_layout_from_transformers_decodes_to_the_lens_figures(family, tiny, cli, tmp_path):
    folder = tiny(family)
    n = int(FAMILIES[family].get("num_hidden_layers", FAMILIES[family].get("n_layer", 0)))
    path = tmp_path / "vllm.safetensors"
    # output_hidden_states: 0 the embedding output, i block i's output; its last is after the
    # final norm, which vLLM's aux states (a block's input) never are: layers 0..L-1
    vllm_file(folder, path, PROMPT, list(range(n)))
    args = ["--position", "all", "--target", "king", "-k", "3"]
    direct = cli.json("lens", folder, PROMPT, "--layers", f"0:{n}", *args)
    result = cli("lens", folder, "--states", path, "--state-layers", f"0:{n}", *args, "--json")
    assert result.exit_code == 0, result.stderr
    decoded = json.loads(result.stdout)
    _close_figures(direct, decoded)
    assert decoded["check"] is None
    assert decoded["states"]["layout"] == "vllm" and decoded["states"]["checked"] is False
    assert "self-check not made" in result.stderr


def test_only_the_tensors_after_the_last_block_are_read(tiny, tmp_path, monkeypatch):
    """Count the tensors read: the final norm and the head (a tied one: the embedding's), no
    other; every other tensor of the model is a zero that takes no memory."""
    import embedlens
    from embedlens.analysis.lens import decoders as tail_module
    from embedlens.compat.transformers import tail_tensors
    from embedlens.io.checkpoint import read_safetensors_header

    read: list[str] = []
    real = tail_tensors.read_folder_tensor

    def counting(place: Any, dtype: Any) -> Any:
        read.append(place.key)
        return real(place, dtype)

    monkeypatch.setattr(tail_tensors, "read_folder_tensor", counting)
    opened: list[Any] = []
    real_open = tail_module.open_tail

    def keeping(*args: Any, **kwargs: Any) -> Any:
        opened.append(real_open(*args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(tail_module, "open_tail", keeping)
    expected = {
        "llama-tied": ["model.norm.weight", "model.embed_tokens.weight"],
        "llama-untied": ["model.norm.weight", "lm_head.weight"],
        "gpt2": ["transformer.ln_f.weight", "transformer.ln_f.bias", "transformer.wte.weight"],
        "opt": ["model.decoder.project_out.weight", "model.decoder.embed_tokens.weight"],
        "phi": [
            "model.final_layernorm.weight",
            "model.final_layernorm.bias",
            "lm_head.weight",
            "lm_head.bias",
        ],
    }
    for family, names in expected.items():
        folder = tiny(family)
        saved = tmp_path / f"{family}.safetensors"
        embedlens.lens(folder, PROMPT, save_states=saved)
        read.clear()
        report = embedlens.lens_states(folder, saved)
        assert read == names, family
        assert report.states is not None and report.states.tensors_read == names
        # in memory: the tensors read, no more (a tied head and its embedding share one)
        model = opened[-1].model
        held = sum(p.numel() for p in model.parameters() if not tail_module.is_placeholder(p))
        header = read_safetensors_header(folder / "model.safetensors").tensors
        assert held == sum(header[name].numel for name in names), family


def test_smollm2_states_decode_to_the_lens_figures(smollm2, cli, tmp_path, monkeypatch):
    """The real GGUF: saved states decode to the lens's figures, reading output_norm and the
    tied token_embd alone; vLLM's layout from the same states too."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from embedlens.compat.transformers import tail_tensors

    saved = tmp_path / "smol.safetensors"
    args = ["--target", " Paris", "-k", "3"]
    direct = cli.json("lens", smollm2, SMOL_PROMPT, *args, "--save-states", saved)
    read: list[str] = []
    real = tail_tensors.GGUFTensors.read

    def counting(self: Any, name: str, dtype: Any) -> Any:
        read.append(self.by_model[name])
        return real(self, name, dtype)

    monkeypatch.setattr(tail_tensors.GGUFTensors, "read", counting)
    decoded = cli.json("lens", smollm2, "--states", saved, *args)
    _same_figures(direct, decoded)
    assert read == ["output_norm.weight", "token_embd.weight"]
    assert decoded["check"]["ok"] is True
    # the same states without the metadata, the last layer and the logits: vLLM's layout
    n = direct["num_layers"]
    with safe_open(str(saved), "pt") as f:
        hidden, ids = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
    vllm = tmp_path / "vllm.safetensors"
    save_file({"hidden_states": hidden[:, 1:n].contiguous(), "token_ids": ids}, str(vllm))
    layered = cli.json("lens", smollm2, SMOL_PROMPT, *args, "--layers", f"1:{n}")
    decoded = cli.json("lens", smollm2, "--states", vllm, "--state-layers", f"1:{n}", *args)
    _same_figures(layered, decoded)
    bf16 = tmp_path / "bf16.safetensors"
    save_file({"hidden_states": hidden.to(torch.bfloat16), "token_ids": ids}, str(bf16))
    rounded = cli.json("lens", smollm2, "--states", bf16, "--state-layers", f"0:{n + 1}", *args)
    assert rounded["layers"][-1]["top"][0]["token"] == direct["layers"][-1]["top"][0]["token"]


@pytest.mark.slow
def test_smollm2_bfloat16_states_decoded_in_float32_are_checked_to_bfloat16(smollm2, cli, tmp_path):
    """States (and logits) a bfloat16 run saved, decoded in float32: the self-check holds them to
    bfloat16's rounding at these logits (as `lens --dtype bfloat16` holds itself), not float32's
    1e-3, which their own rounding passes (0.13 here); decoded in bfloat16, the same tolerance."""
    saved = tmp_path / "bf16.safetensors"
    run = cli.json("lens", smollm2, SMOL_PROMPT, "--dtype", "bfloat16", "--save-states", saved)
    decoded = cli.json("lens", smollm2, "--states", saved)
    check, own = decoded["check"], run["check"]
    assert decoded["dtype"] == "float32" and check["ok"] is True
    assert 1e-3 < check["max_abs_logit_diff"] <= check["tolerance"] == own["tolerance"]
    assert cli.json("lens", smollm2, "--states", saved, "--dtype", "bfloat16")["check"] == {
        **own,
        "max_abs_logit_diff": 0.0,
    }


def _bad(tmp_path: Path, name: str, tensors: dict[str, Any]) -> Path:
    from safetensors.torch import save_file

    path = tmp_path / name
    save_file(tensors, str(path))
    return path


def test_files_that_do_not_fit_are_refused_with_one_line(tiny, cli, tmp_path):
    import torch

    folder = tiny("llama-tied")  # hidden size 32, 3 blocks
    ids = torch.tensor([5, 6, 7])
    wide = _bad(tmp_path, "wide.st", {"hidden_states": torch.zeros(3, 2, 48), "token_ids": ids})
    err = cli.fails("lens", folder, "--states", wide, "--state-layers", "1,2", code=2)
    assert "width 48" in err and "hidden size is 32" in err
    four = _bad(tmp_path, "four.st", {"hidden_states": torch.zeros(3, 2, 32), "token_ids": ids})
    err = cli.fails("lens", folder, "--states", four, "--state-layers", "1,2,3", code=2)
    assert "names 3 layers, but its hidden_states hold 2" in err
    err = cli.fails("lens", folder, "--states", four, "--state-layers", "3,4", code=2)
    assert "holds layer 4" in err and "0..3" in err
    err = cli.fails("lens", folder, "--states", four, code=2)
    assert "--state-layers" in err
    nan = torch.zeros(3, 2, 32)
    nan[2, 1, 5] = float("nan")
    bad = _bad(tmp_path, "nan.st", {"hidden_states": nan, "token_ids": ids})
    err = cli.fails("lens", folder, "--states", bad, "--state-layers", "1,2", code=1)
    assert "NaN state at layer 2, position 2" in err
    cut = tmp_path / "cut.st"
    cut.write_bytes(four.read_bytes()[:-10])
    err = cli.fails("lens", folder, "--states", cut, "--state-layers", "1,2", code=1)
    assert "truncated" in err or "corrupt" in err
    err = cli.fails("lens", folder, "the king", "--states", four, "--state-layers", "1,2", code=2)
    assert "PROMPT does not apply" in err
    saved = tmp_path / "saved.st"
    assert cli("lens", folder, PROMPT, "--save-states", saved).exit_code == 0
    # another model of the same shape: the self-check against the file's logits says so
    other = cli("lens", tiny("gpt2"), "--states", saved, "--json")
    assert other.exit_code == 0 and json.loads(other.stdout)["check"]["ok"] is False
    assert "does not reproduce the logits the file holds" in other.stderr
    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPT + "\n", encoding="utf-8")
    err = cli.fails("lens", folder, "--prompts", prompts, "--save-states", saved, code=2)
    assert "is a file: with --prompts it names a folder" in err


def test_lens_states_takes_paths_and_a_tuned_lens(tiny, tmp_path):
    """The Python API takes paths; a tuned lens decodes states as it decodes the model's."""
    import embedlens
    from tests.test_tune import words_file

    folder = tiny("llama-tied")
    saved = tmp_path / "states.safetensors"
    embedlens.lens(folder, PROMPT, save_states=saved)
    as_path = embedlens.lens_states(folder, saved).to_dict()
    as_text = embedlens.lens_states(str(folder), str(saved)).to_dict()
    assert as_path == as_text
    small = {"tokens": 512, "eval_tokens": 128, "method": "affine"}
    embedlens.tune(folder, words_file(tmp_path / "words.txt"), tmp_path / "lens", **small)
    direct = embedlens.lens(folder, PROMPT, tuned=tmp_path / "lens").to_dict()
    decoded = embedlens.lens_states(folder, saved, tuned=tmp_path / "lens").to_dict()
    assert decoded["tuned"] == direct["tuned"]
    _same_figures(direct, decoded)


def test_a_states_file_is_the_same_bytes_from_every_process(tiny, tmp_path):
    """The same states give the same file: safetensors' own writer orders the metadata by a hash
    seeded anew in each process (two runs of `--save-states` gave the same tensors under headers
    in another order); embedlens writes it sorted, otherwise as safetensors lays a file out."""
    import os
    import subprocess
    import sys

    import torch
    from safetensors import safe_open
    from safetensors.torch import save

    from embedlens.io.tensor_bytes import write_safetensors

    folder = tiny("llama-tied")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    files = [tmp_path / f"states-{i}.safetensors" for i in range(2)]
    for path in files:
        done = subprocess.run(
            [sys.executable, "-m", "embedlens", "lens", str(folder), PROMPT, "--save-states",
             str(path), "--json"], env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    assert files[0].read_bytes() == files[1].read_bytes()
    with safe_open(str(files[0]), "pt") as f:
        assert f.metadata()["prompt"] == PROMPT
    data = files[0].read_bytes()
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    assert list(header["__metadata__"]) == sorted(header["__metadata__"])
    # laid out as safetensors lays it out: with one metadata key, the bytes of its own writer
    torch.manual_seed(0)
    tensors = {
        "token_ids": torch.tensor([3, 1, 2]),
        "hidden_states": torch.randn(3, 2, 4),
        "logits": torch.randn(5),
        "b": torch.randn(3, dtype=torch.bfloat16),
    }
    mine = tmp_path / "mine.safetensors"
    write_safetensors(mine, tensors, {"format": "pt"})
    assert mine.read_bytes() == save(tensors, metadata={"format": "pt"})
