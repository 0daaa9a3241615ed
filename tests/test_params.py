"""`embedlens params`: exact figures from configs, headers, built and loaded models."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.models import FAMILIES, write_config

CONFIGS = Path(__file__).parent / "configs"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """Folders holding only the public configs of REFERENCE.md's models."""

    def folder(name: str) -> Path:
        target = tmp_path_factory.getbasetemp() / "reference" / name
        if not target.exists():
            write_config(target, json.loads((CONFIGS / f"{name}.json").read_text()))
        return target

    return folder


def test_qwen3_0_6b_from_config(cli, reference):
    data = cli.json("params", reference("Qwen3-0.6B"), "--meta-only")
    assert data["source"] == "meta"
    assert data["total"] == 596_049_920
    assert data["embedding"] == 155_582_464
    assert data["lm_head"] == 0 and data["tied"] is True
    assert round(data["embedding_fraction"], 3) == 0.261
    assert data["embedding_lm_head_fraction"] == data["embedding_fraction"]
    assert (data["vocab_size"], data["hidden_size"], data["num_layers"]) == (151936, 1024, 28)
    assert data["head_flops_per_token"] == 2 * 151936 * 1024  # about 311 million
    # The seed's "about a quarter of each token's computation": 2·V·d against 2 per block weight.
    blocks = 596_049_920 - 155_582_464
    assert data["forward_flops_per_token"] == 2 * blocks + 2 * 151936 * 1024
    assert round(data["head_flops_fraction"], 2) == 0.26
    assert data["dtype"] == "bfloat16" and data["total_bytes"] == 2 * 596_049_920


def test_llama3_70b_embedding_and_head_are_three_percent(cli, reference):
    data = cli.json("params", reference("Meta-Llama-3-70B"), "--meta-only")
    assert data["total"] == 70_553_706_496
    assert data["embedding"] == data["lm_head"] == 1_050_673_152
    assert data["tied"] is False
    assert round(data["embedding_fraction"], 4) == 0.0149
    assert round(data["embedding_lm_head_fraction"], 4) == 0.0298
    names = [g["name"] for g in data["groups"]]
    assert names == ["embedding", "lm_head", "blocks", "final_norm"]


def test_qwen2_5_7b_seed_exercise(cli, reference):
    data = cli.json("params", reference("Qwen2.5-7B"), "--meta-only")
    assert data["total"] == 7_615_616_512
    assert data["embedding"] + data["lm_head"] == 1_089_994_752
    assert round(data["embedding_lm_head_fraction"], 3) == 0.143


def test_deepseek_v3_moe_active_parameters(cli, reference):
    data = cli.json("params", reference("DeepSeek-V3"), "--meta-only")
    assert data["vocab_size"] == 129_280
    moe = data["moe"]
    assert moe["num_experts"] == 256 and moe["experts_per_token"] == 8
    # Active = everything but the 248 routed experts a token skips in each MoE layer.
    assert moe["active_params"] == data["total"] - moe["expert_params"] * 248 // 256
    assert 660e9 < data["total"] < 680e9 and 35e9 < moe["active_params"] < 40e9


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_header_meta_and_weights_agree_with_transformers(cli, tiny, family):
    from transformers import AutoModelForCausalLM

    folder = tiny(family)
    model = AutoModelForCausalLM.from_pretrained(folder)
    expected = sum(p.numel() for p in model.parameters())  # unique parameters: tied once
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    tied = head is embed
    by_source = {}
    for flag, source in ((None, "header"), ("--meta-only", "meta"), ("--load", "weights")):
        data = cli.json("params", folder, *([flag] if flag else []))
        assert data["source"] == source
        assert data["total"] == expected, (family, source)
        assert data["embedding"] == embed.numel()
        assert data["tied"] is tied
        assert data["lm_head"] == (0 if tied else head.numel())
        assert sum(g["params"] for g in data["groups"]) == data["total"]
        assert abs(sum(g["fraction"] for g in data["groups"]) - 1) < 1e-9
        blocks = next(g for g in data["groups"] if g["name"] == "blocks")
        assert sum(p["params"] for p in data["block_parts"]) == blocks["params"]
        by_source[source] = data
    assert (
        by_source["header"]["groups"]
        == by_source["meta"]["groups"]
        == [g for g in by_source["weights"]["groups"]]
    )


def test_moe_tiny_active_parameters(cli, tiny):
    folder = tiny("qwen3-moe")
    data = cli.json("params", folder)
    cfg = FAMILIES["qwen3-moe"]
    d, inter, layers = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_hidden_layers"]
    per_expert = 3 * d * inter
    assert data["moe"]["expert_params"] == layers * cfg["num_experts"] * per_expert
    skipped = layers * (cfg["num_experts"] - cfg["num_experts_per_tok"]) * per_expert
    assert data["moe"]["active_params"] == data["total"] - skipped
    parts = {p["name"]: p["params"] for p in data["block_parts"]}
    assert parts["router"] == layers * cfg["num_experts"] * d


def test_per_block_rows(cli, tiny):
    data = cli.json("params", tiny("llama-untied"), "--per-block")
    rows = data["blocks"]
    assert [r["layer"] for r in rows] == [0, 1, 2]
    blocks = next(g for g in data["groups"] if g["name"] == "blocks")
    assert sum(r["params"] for r in rows) == blocks["params"]
    assert all(r["params"] == r["attention"] + r["mlp"] + r["norms"] for r in rows)


def test_position_embeddings_and_bytes(cli, tiny):
    data = cli.json("params", tiny("gpt2"))
    groups = {g["name"]: g for g in data["groups"]}
    assert groups["position_embedding"]["params"] == 64 * 32
    assert data["dtype"] == "float32"
    assert data["total_bytes"] == 4 * data["total"]


def test_sharded_checkpoint_from_headers(cli, tiny):
    single = cli.json("params", tiny("llama-untied"))
    sharded_folder = tiny("llama-untied", max_shard_size="20KB")
    assert (sharded_folder / "model.safetensors.index.json").is_file()
    sharded = cli.json("params", sharded_folder)
    assert sharded["total"] == single["total"] and sharded["groups"] == single["groups"]


def test_smollm2_gguf(cli, smollm2):
    data = cli.json("params", smollm2)
    assert data["source"] == "header"
    assert data["total"] == 134_515_008
    assert data["embedding"] == 28_311_552 == 49152 * 576
    assert round(data["embedding_fraction"], 3) == 0.210
    assert data["tied"] is True and data["lm_head"] == 0
    assert data["num_layers"] == 30
    embedding = next(g for g in data["groups"] if g["name"] == "embedding")
    assert embedding["bytes"] == 49152 * 576 // 32 * 34  # Q8_0 blocks: 32 values in 34 bytes


def test_table_output(cli, tiny):
    result = cli("params", tiny("llama-tied"))
    assert result.exit_code == 0, result.stderr
    assert "embedding (tied with the head)" in result.stdout
    assert "decoder blocks" in result.stdout and "total" in result.stdout
    assert "2·V·d" in result.stdout


@pytest.mark.slow
def test_header_mode_imports_no_torch(tiny):
    folder = tiny("llama-untied")
    code = (
        "import sys\n"
        "from embedlens.cli import app\n"
        "try:\n"
        f"    app(['params', {str(folder)!r}, '--json'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out.splitlines()[0])["source"] == "header"
    assert out.splitlines()[-1] == "HEAVY []"


def test_stored_copy_of_a_tied_head_is_counted_once(cli, tiny, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "copy"
    shutil.copytree(tiny("llama-tied"), folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    result = cli("params", folder, "--json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data["total"] == cli.json("params", tiny("llama-tied"))["total"]
    assert data["tied"] is True
    assert "counted once" in result.stderr
