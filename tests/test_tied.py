"""`embedlens tied`: each piece of evidence, the verdict and the savings."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.models import FAMILIES


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_verdict_matches_the_loaded_model(cli, tiny, family):
    from transformers import AutoModelForCausalLM

    folder = tiny(family)
    model = AutoModelForCausalLM.from_pretrained(folder)
    embed = model.get_input_embeddings().weight
    expected = model.get_output_embeddings().weight.data_ptr() == embed.data_ptr()
    data = cli.json("tied", folder, "--load")
    assert data["tied"] is expected
    assert data["evidence"]["same_storage"] is expected
    assert data["evidence"]["checkpoint_has_lm_head"] is (not expected)
    assert data["shape"] == list(embed.shape)
    assert data["saved_params"] == (embed.numel() if expected else 0)
    assert data["consistent"] is True


def test_header_evidence_needs_no_model(cli, tiny):
    data = cli.json("tied", tiny("llama-tied"))
    assert data["tied"] is True
    assert data["evidence"] == {
        "config": True,
        "checkpoint_has_lm_head": False,
        "same_storage": None,
    }
    assert data["saved_params"] == 72 * 32
    assert data["saved_bytes"] == 72 * 32 * 4
    untied = cli.json("tied", tiny("llama-untied"))
    assert untied["tied"] is False and untied["saved_params"] == 0
    assert untied["evidence"]["checkpoint_has_lm_head"] is True


def test_meta_build_compares_parameter_identity(cli, tiny):
    data = cli.json("tied", tiny("qwen3"), "--meta-only")
    assert data["evidence"]["same_storage"] is True
    assert data["evidence"]["checkpoint_has_lm_head"] is None  # the checkpoint was not read
    assert "identity" in data["verdict"]
    untied = cli.json("tied", tiny("phi3"), "--meta-only")
    assert untied["evidence"]["same_storage"] is False and untied["tied"] is False


def test_gpt2_config_silent_on_the_flag(cli, tiny, tmp_path):
    folder = tmp_path / "gpt2"
    shutil.copytree(tiny("gpt2"), folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("tie_word_embeddings", None)
    (folder / "config.json").write_text(json.dumps(config))
    data = cli.json("tied", folder)
    assert data["evidence"]["config"] is None
    assert data["tied"] is True  # the checkpoint has no head of its own
    loaded = cli.json("tied", folder, "--load")
    assert loaded["evidence"]["config"] is True  # GPT-2's class default, once transformers reads it


def test_smollm2_gguf_is_tied(cli, smollm2):
    data = cli.json("tied", smollm2)
    assert data["tied"] is True
    assert data["shape"] == [49152, 576]
    assert data["saved_params"] == 28_311_552
    assert data["evidence"]["checkpoint_has_lm_head"] is False


def test_qwen3_0_6b_saves_its_embedding(cli, tmp_path):
    from pathlib import Path

    from tests.models import write_config

    config = json.loads((Path(__file__).parent / "configs" / "Qwen3-0.6B.json").read_text())
    data = cli.json("tied", write_config(tmp_path / "q", config), "--meta-only")
    assert data["tied"] is True and data["saved_params"] == 155_582_464
    assert data["saved_bytes"] == 2 * 155_582_464  # bfloat16
    assert round(data["saved_fraction"], 3) == 0.261


def test_disagreeing_evidence_is_reported(cli, tiny, tmp_path):
    folder = tmp_path / "odd"
    shutil.copytree(tiny("llama-untied"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (folder / "config.json").write_text(json.dumps(config))
    result = cli("tied", folder, "--load", "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    # transformers 5 keeps a stored head that differs from the embedding, whatever the flag says
    assert data["tied"] is False
    assert data["evidence"] == {
        "config": True,
        "checkpoint_has_lm_head": True,
        "same_storage": False,
    }
    assert data["consistent"] is False
    assert "disagrees" in result.stderr
    header = cli("tied", folder, "--json")
    assert json.loads(header.stdout)["tied"] is False
    assert "keeps the two apart" in header.stderr


def test_table(cli, tiny):
    result = cli("tied", tiny("llama-tied"))
    assert result.exit_code == 0
    assert "TIED" in result.stdout and "saves 2,304 parameters" in result.stdout
