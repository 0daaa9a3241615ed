"""`params` on quantised checkpoints: logical parameters from headers, bookkeeping apart.

Three kinds of files: tiny checkpoints compressed-tensors made (tests/data/quant, made by
bench/make_quant_checkpoints.py), tiny ones laid out here from each format's specification (GPTQ,
AWQ, bitsandbytes, MLX, ModelOpt, MXFP4, DeepSeek's FP8), and full-size layouts of published
checkpoints as sparse files (headers, and holes for the data). Each count is checked against a
meta-device build of the unquantised config (plus the parts that build leaves out), and where the
format's own library dequantises on CPU, against it.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from tests.quant_layouts import (
    cdiv,
    fp8_block,
    meta_shapes,
    mxfp4_experts,
    numel,
    pack_quantized,
    per_expert,
    quantise,
    write_sparse,
)

DATA = Path(__file__).parent / "data" / "quant"
CONFIGS = Path(__file__).parent / "configs"
TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
    "tie_word_embeddings": False, "dtype": "bfloat16",
}  # fmt: skip
TINY_TOTAL = 106_816  # 2·256·64 + 2·(12,288 attention + 24,576 MLP + 128 norms) + 64


def file_data_bytes(folder: Path) -> int:
    """Bytes of all tensors of a folder's safetensors files (each file less its header)."""
    total = 0
    for path in folder.glob("*.safetensors"):
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
        total += path.stat().st_size - 8 - n
    return total


@pytest.fixture(scope="module")
def tiny_shapes() -> dict[str, tuple[int, ...]]:
    return meta_shapes(TINY)


def test_tiny_reference_total(tiny_shapes):
    assert sum(numel(s) for s in tiny_shapes.values()) == TINY_TOTAL


@pytest.mark.parametrize(
    ("scheme", "bits", "kinds"),
    [
        ("w4a16", 4.0, {"scales", "state"}),
        ("w8a8", 8.0, {"scales"}),
        ("fp8_block", 8.0, {"scales"}),
        ("nvfp4a16", 4.0, {"scales", "global scales"}),
    ],
)
def test_compressed_tensors_checkpoints(cli, scheme, bits, kinds):
    folder = DATA / scheme
    data = cli.json("params", folder)
    assert data["source"] == "header" and data["quantised"] is True
    assert data["total"] == TINY_TOTAL
    assert (data["embedding"], data["lm_head"]) == (256 * 64, 256 * 64)
    parts = {p["name"]: p for p in data["block_parts"]}
    assert parts["attention"]["bits_per_param"] == bits == parts["mlp"]["bits_per_param"]
    assert all(g["dtype"] and "?" not in g["dtype"] for g in data["groups"] + data["block_parts"])
    assert data["dtype"].startswith("mixed (bfloat16, ")
    assert {b["kind"] for b in data["bookkeeping"]} == kinds
    assert data["stored_bytes"] == file_data_bytes(folder)
    assert data["stored_bytes"] == data["total_bytes"] + data["bookkeeping_bytes"]
    meta = cli.json("params", folder, "--meta-only")
    assert meta["total"] == TINY_TOTAL and meta["quantised"] is True
    assert abs(meta["stored_bytes"] - data["stored_bytes"]) <= data["stored_bytes"] / 100
    assert [g["bytes"] for g in meta["groups"]] == [g["bytes"] for g in data["groups"]]
    assert [g["dtype"] for g in meta["block_parts"]] == [g["dtype"] for g in data["block_parts"]]


@pytest.mark.skipif(
    importlib.util.find_spec("compressed_tensors") is None, reason="needs compressed-tensors"
)
@pytest.mark.parametrize("scheme", ["w4a16", "w8a8", "fp8_block", "nvfp4a16"])
def test_compressed_tensors_own_decompression_agrees(cli, scheme):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    folder = DATA / scheme
    model = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=CompressedTensorsConfig(run_compressed=False)
    )
    weights = {n: p for n, p in model.named_parameters() if n.endswith(".weight")}
    data = cli.json("params", folder)
    assert sum(p.numel() for p in weights.values()) == data["total"]
    # --load: the model as transformers keeps it (packed), read as its headers are
    loaded = cli.json("params", folder, "--load")
    assert loaded["source"] == "weights" and loaded["total"] == data["total"]
    assert loaded["stored_bytes"] == data["stored_bytes"] and loaded["quantised"] is True


def _layout(folder: Path, stored, config: dict, **kw) -> Path:
    write_sparse(folder, stored, config, **kw)
    return folder


def _linear(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and ".layers." in name and name.endswith("proj.weight")


def _gptq(bits: int, group: int, *, g_idx: bool = True):
    def lay(name, shape):
        m = name.removesuffix(".weight")
        out, inn = shape
        groups = cdiv(inn, group)
        stored = [
            (m + ".qweight", "I32", (inn * bits // 32, out)),
            (m + ".qzeros", "I32", (groups, out * bits // 32)),
            (m + ".scales", "F16", (groups, out)),
        ]
        return stored + ([(m + ".g_idx", "I32", (inn,))] if g_idx else [])

    return lay


def _awq(name, shape):
    m = name.removesuffix(".weight")
    out, inn = shape
    return [
        (m + ".qweight", "I32", (inn, out // 8)),
        (m + ".qzeros", "I32", (inn // 32, out // 8)),
        (m + ".scales", "F16", (inn // 32, out)),
    ]


def _modelopt_nvfp4(name, shape):
    m = name.removesuffix(".weight")
    out, inn = shape
    return [
        (name, "U8", (out, inn // 2)),
        (m + ".weight_scale", "F8_E4M3", (out, inn // 16)),
        (m + ".weight_scale_2", "F32", ()),
        (m + ".input_scale", "F32", ()),
    ]


def _bnb8(name, shape):
    m = name.removesuffix(".weight")
    return [(name, "I8", shape), (m + ".SCB", "F32", (shape[0],)), (m + ".weight_format", "U8", ())]


def _ct_int4(name, shape):
    m = name.removesuffix(".weight")
    return [(name, "I8", shape), (m + ".weight_scale", "BF16", (shape[0], 1))]


SPEC_LAYOUTS = {
    # name: (quantization_config, how each block Linear is stored, bits per parameter)
    "gptq-4bit": ({"quant_method": "gptq", "bits": 4, "group_size": 32}, _gptq(4, 32), 4.0),
    "gptq-8bit": ({"quant_method": "gptq", "bits": 8, "group_size": 64}, _gptq(8, 64), 8.0),
    "gptq-3bit": ({"quant_method": "gptq", "bits": 3, "group_size": 32}, _gptq(3, 32), 3.0),
    "awq-4bit": (
        {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"},
        _awq,
        4.0,
    ),
    "modelopt-nvfp4": (
        {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16},
        _modelopt_nvfp4,
        4.0,
    ),
    "bnb-int8": ({"quant_method": "bitsandbytes", "load_in_8bit": True}, _bnb8, 8.0),
    "ct-int4-int-quantized": (
        {
            "quant_method": "compressed-tensors",
            "format": "int-quantized",
            "config_groups": {
                "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int"}}
            },
            "ignore": ["lm_head"],
        },
        _ct_int4,
        8.0,  # int-quantized keeps a 4-bit value in an int8 byte
    ),
    "deepseek-fp8": (
        {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"},
        fp8_block,
        8.0,
    ),
}


@pytest.mark.parametrize("name", sorted(SPEC_LAYOUTS))
def test_layouts_from_their_specifications(cli, tmp_path, tiny_shapes, name):
    quant, lay, bits = SPEC_LAYOUTS[name]
    stored = quantise(tiny_shapes, _linear, lay)
    folder = _layout(tmp_path / name, stored, {**TINY, "quantization_config": quant})
    data = cli.json("params", folder)
    assert data["total"] == TINY_TOTAL, name
    parts = {p["name"]: p for p in data["block_parts"]}
    assert parts["mlp"]["bits_per_param"] == bits
    assert data["stored_bytes"] == file_data_bytes(folder)
    assert data["bookkeeping_bytes"] > 0 and None not in [g["dtype"] for g in data["groups"]]
    meta = cli.json("params", folder, "--meta-only")
    assert meta["total"] == TINY_TOTAL
    if name != "ct-int4-int-quantized":  # its bits cannot say the int8 container
        assert abs(meta["stored_bytes"] - data["stored_bytes"]) <= data["stored_bytes"] / 100


def test_compressed_tensors_groups_by_target_and_ignore(cli, tmp_path, tiny_shapes):
    """Two config groups: 8-bit for the MLP (a regular expression), 4-bit for the other Linear
    layers; the attention's output projection ignored."""
    quant = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "mlp": {"targets": ["re:.*mlp.*"], "weights": {"num_bits": 8, "group_size": 32}},
            "rest": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 32}},
        },
        "ignore": ["lm_head", "re:.*o_proj"],
    }

    def lay(name, shape):
        bits = 8 if ".mlp." in name else 4
        return pack_quantized(bits, 32)(name, shape)

    stored = quantise(tiny_shapes, lambda n, s: _linear(n, s) and "o_proj" not in n, lay)
    folder = _layout(tmp_path / "groups", stored, {**TINY, "quantization_config": quant})
    data = cli.json("params", folder)
    assert data["total"] == TINY_TOTAL
    parts = {p["name"]: p for p in data["block_parts"]}
    assert parts["mlp"]["bits_per_param"] == 8.0
    attention = 2 * (4096 + 2048 + 2048) * 4 + 2 * 4096 * 16  # q, k, v at 4 bits, o at 16
    assert parts["attention"]["bytes"] * 8 == attention
    meta = cli.json("params", folder, "--meta-only")
    assert abs(meta["stored_bytes"] - data["stored_bytes"]) <= data["stored_bytes"] / 100


def test_mlx_quantised_embedding_and_head(cli, tmp_path, tiny_shapes):
    """MLX packs 32/bits values a uint32 word, embedding and head included; a layer of its own
    settings (8 bits) is read by them."""
    quant = {
        "group_size": 32,
        "bits": 4,
        "model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8},
    }

    def lay(name, shape):
        m = name.removesuffix(".weight")
        bits = 8 if m == "model.layers.0.mlp.down_proj" else 4
        groups = (*shape[:-1], shape[-1] // 32)
        return [
            (name, "U32", (*shape[:-1], shape[-1] * bits // 32)),
            (m + ".scales", "F16", groups),
            (m + ".biases", "F16", groups),
        ]

    chosen = lambda n, s: len(s) == 2  # noqa: E731  every matrix, embedding and head too
    stored = quantise(tiny_shapes, chosen, lay)
    folder = _layout(tmp_path / "mlx", stored, {**TINY, "quantization": quant})
    data = cli.json("params", folder)
    assert data["total"] == TINY_TOTAL
    assert (data["vocab_size"], data["hidden_size"]) == (256, 64)
    groups = {g["name"]: g for g in data["groups"]}
    assert groups["embedding"]["bits_per_param"] == 4.0
    assert groups["embedding"]["dtype"].startswith("int4 (mlx, groups of 32)")
    assert data["stored_bytes"] == file_data_bytes(folder)
    where = cli.json("addr", folder, "3")  # the rows are read (tests/test_packed_rows.py)
    assert (where["shape"], where["row_bytes"]) == ([256, 64], 32)
    assert where["dtype"] == "int4 (mlx, groups of 32)" and where["check"]["all_equal"]
    result = cli("tied", folder, "--load")  # transformers cannot load MLX
    assert result.exit_code == 1
    assert "quantised by MLX" in result.stderr and "Traceback" not in result.stderr


def test_bitsandbytes_4bit_shape_from_its_state(cli, tmp_path, tiny_shapes):
    """bitsandbytes' 4-bit weight is a flat U8 [n/2, 1]; its shape is in the packed state."""
    from safetensors.numpy import save_file

    tensors = {}
    for name, shape in tiny_shapes.items():
        if not _linear(name, shape):
            tensors[name] = np.zeros(shape, np.float16)
            continue
        n = numel(shape)
        state = json.dumps({"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16",
                            "shape": list(shape)}).encode()  # fmt: skip
        tensors[name] = np.zeros((n // 2, 1), np.uint8)
        tensors[name + ".absmax"] = np.ones(n // 64, np.float32)
        tensors[name + ".quant_map"] = np.zeros(16, np.float32)
        tensors[name + ".quant_state.bitsandbytes__nf4"] = np.frombuffer(state, np.uint8)
    folder = tmp_path / "bnb4"
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors")
    quant = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    (folder / "config.json").write_text(json.dumps({**TINY, "quantization_config": quant}))
    data = cli.json("params", folder)
    assert data["total"] == TINY_TOTAL
    parts = {p["name"]: p for p in data["block_parts"]}
    assert parts["mlp"]["bits_per_param"] == 4.0 and "nf4 (bitsandbytes)" in parts["mlp"]["dtype"]
    assert {b["kind"] for b in data["bookkeeping"]} == {"scales", "state"}
    meta = cli.json("params", folder, "--meta-only")
    assert abs(meta["stored_bytes"] - data["stored_bytes"]) <= data["stored_bytes"] / 100


GPT_OSS_TINY = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_local_experts": 4, "num_experts_per_tok": 2, "layer_types":
    ["sliding_attention", "full_attention"], "sliding_window": 8, "tie_word_embeddings": False,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert":
    ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
}  # fmt: skip


def test_mxfp4_against_transformers_dequantisation(cli, tmp_path):
    """gpt-oss's MXFP4 experts: each 16-byte block holds 32 values, as transformers' own
    dequantiser unpacks them."""
    import torch
    from safetensors.numpy import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    shapes = meta_shapes(GPT_OSS_TINY)
    rng = np.random.default_rng(0)
    tensors, unpacked = {}, 0
    for name, dtype, shape in mxfp4_experts(shapes):
        if dtype == "U8":
            tensors[name] = rng.integers(0, 256, shape, dtype=np.uint8)
            if name.endswith("_blocks"):
                scales = rng.integers(120, 130, shape[:-1], dtype=np.uint8)
                out = convert_moe_packed_tensors(
                    torch.from_numpy(tensors[name]), torch.from_numpy(scales)
                )
                unpacked += out.numel()
        else:
            tensors[name] = np.zeros(shape, np.float32)
    folder = tmp_path / "gpt-oss"
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(GPT_OSS_TINY))
    data = cli.json("params", folder)
    total = sum(numel(s) for s in shapes.values())
    assert data["total"] == total
    experts = sum(numel(s) for n, s in shapes.items() if n.endswith(("gate_up_proj", "down_proj")))
    biases = sum(numel(s) for n, s in shapes.items() if n.endswith("proj_bias"))
    assert unpacked == experts
    assert data["moe"]["expert_params"] == experts + biases == 99_840  # the figure
    parts = {p["name"]: p for p in data["block_parts"]}
    assert parts["experts"]["dtype"] == "float32, mxfp4 + e8m0 scales"  # biases in float32
    meta = cli.json("params", folder, "--meta-only")
    assert meta["total"] == total
    assert abs(meta["stored_bytes"] - data["stored_bytes"]) <= data["stored_bytes"] / 100


def test_stated_total_parameters_compared(cli, tmp_path, tiny_shapes):
    stored = quantise(tiny_shapes, _linear, pack_quantized(4, 32))
    quant = SPEC_LAYOUTS["ct-int4-int-quantized"][0] | {"format": "pack-quantized"}
    folder = _layout(
        tmp_path / "stated",
        stored,
        {**TINY, "quantization_config": quant},
        shards=2,
        index_metadata={"total_parameters": 42_000},
    )
    result = cli("params", folder, "--json")
    data = json.loads(result.stdout)
    assert data["stated_total"] == 42_000 and data["total"] == TINY_TOTAL
    assert "states total_parameters 42,000" in result.stderr


def test_quantised_header_count_imports_no_torch(tmp_path, tiny_shapes):
    import subprocess
    import sys

    stored = quantise(tiny_shapes, _linear, fp8_block)
    quant = SPEC_LAYOUTS["deepseek-fp8"][0]
    folder = _layout(tmp_path / "fp8", stored, {**TINY, "quantization_config": quant})
    code = (
        "import sys, json\n"
        "from embedlens import params\n"
        f"r = params({str(folder)!r})\n"
        "print(r.total, [m for m in ('torch', 'transformers') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(TINY_TOTAL), "[]"]


# Full-size layouts of published checkpoints: headers and holes.


def _ds_config(name: str) -> dict:
    config = json.loads((CONFIGS / f"{name}.json").read_text())
    config.pop("auto_map", None)
    return config


def _mtp_layer(shapes: dict, last: int, v: int, d: int) -> dict:
    """DeepSeek-V3's multi-token-prediction layer as its checkpoint stores it: a decoder block
    (the same tensors as the last one) and its own embedding, norms, projection and head."""
    mtp = {n.replace(f"layers.{last}.", f"layers.{last + 1}."): s for n, s in shapes.items()
           if f".layers.{last}." in n}  # fmt: skip
    p = f"model.layers.{last + 1}."
    mtp |= {p + "embed_tokens.weight": (v, d), p + "enorm.weight": (d,), p + "hnorm.weight": (d,),
            p + "eh_proj.weight": (d, 2 * d), p + "shared_head.norm.weight": (d,),
            p + "shared_head.head.weight": (v, d)}  # fmt: skip
    return mtp


@pytest.mark.slow
def test_deepseek_v3_full_size(cli, tmp_path):
    """163 shards, FP8 with 128x128 block scales, the MTP layer 61 and the routers' correction
    biases (buffers in transformers' build, tensors in the checkpoint)."""
    config = _ds_config("DeepSeek-V3")
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic", "weight_block_size": [128, 128]}  # fmt: skip
    shapes = meta_shapes(config, ("e_score_correction_bias",))
    built = sum(numel(s) for n, s in shapes.items() if not n.endswith("e_score_correction_bias"))
    split = per_expert(shapes)
    mtp = _mtp_layer(split, 60, 129_280, 7168)
    split |= mtp
    stored = quantise(split, lambda n, s: _linear(n, s) and "embed" not in n, fp8_block)
    folder = _layout(tmp_path / "ds", stored, config, shards=163)
    data = cli.json("params", folder)
    left_out = 58 * 256 + sum(numel(s) for s in mtp.values())
    assert data["total"] == built + left_out
    assert 670e9 < built < 672e9 and 13e9 < sum(numel(s) for s in mtp.values()) < 15e9
    parts = {p["name"]: p["params"] for p in data["parts"]}
    assert parts["mtp"] == sum(numel(s) for s in mtp.values())
    assert 37e9 < data["moe"]["active_params"] < 38e9
    assert data["stored_bytes"] == file_data_bytes(folder)
    meta = cli.json("params", folder, "--meta-only")
    assert meta["total"] == built
    mtp_bytes = sum(p["bytes"] for p in data["parts"] if p["name"] == "mtp")
    mtp_book = sum(cdiv(s[0], 128) * cdiv(s[1], 128) * 4 for n, s in mtp.items()
                   if _linear(n, s) and "embed" not in n)  # fmt: skip
    file_model = data["stored_bytes"] - mtp_bytes - mtp_book - 58 * 256 * 4
    assert abs(meta["stored_bytes"] - file_model) <= file_model / 100


@pytest.mark.slow
def test_gpt_oss_120b_full_size(cli, tmp_path):
    config = json.loads((CONFIGS / "gpt-oss-120b.json").read_text())
    shapes = meta_shapes(config)
    folder = _layout(tmp_path / "gpt-oss", mxfp4_experts(shapes), config, shards=15)
    data = cli.json("params", folder)
    built = sum(numel(s) for s in shapes.values())
    assert data["total"] == built
    assert round(built / 1e9, 1) == 116.8
    # OpenAI's 5.1B active leaves the embedding out (a lookup); moe.active_params keeps it
    active = data["moe"]["active_params"]
    assert round((active - data["embedding"]) / 1e9, 2) == 5.13
    meta = cli.json("params", folder, "--meta-only")
    assert abs(meta["stored_bytes"] - data["stored_bytes"]) <= data["stored_bytes"] / 100


@pytest.mark.slow
def test_kimi_k2_int4_full_size(cli, tmp_path):
    """Kimi-K2 as its int4 release stores it: compressed-tensors pack-quantized experts in
    groups of 32, the rest in bfloat16."""
    config = _ds_config("Kimi-K2")
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "group_size": 32, "strategy": "group", "symmetric": True, "type": "int"}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"],
    }  # fmt: skip
    shapes = meta_shapes(config, ("e_score_correction_bias",))
    built = sum(numel(s) for n, s in shapes.items() if not n.endswith("e_score_correction_bias"))
    split = per_expert(shapes)
    stored = quantise(
        split, lambda n, s: ".experts." in n and n.endswith(".weight"), pack_quantized(4, 32)
    )
    folder = _layout(tmp_path / "kimi", stored, config, shards=62)
    data = cli.json("params", folder)
    assert data["total"] == built + 60 * 384
    assert round(built / 1e12, 2) == 1.03
    meta = cli.json("params", folder, "--meta-only")
    assert abs(meta["stored_bytes"] - data["stored_bytes"]) <= data["stored_bytes"] / 100


@pytest.mark.slow
def test_llama_3_1_8b_w4a16_full_size(cli, tmp_path):
    config = json.loads((CONFIGS / "Llama-3.1-8B.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "group_size": 128, "strategy": "group", "symmetric": True, "type": "int"}}},
    }  # fmt: skip
    shapes = meta_shapes(config)
    stored = quantise(shapes, _linear, pack_quantized(4, 128))
    folder = _layout(tmp_path / "llama", stored, config, shards=2)
    data = cli.json("params", folder)
    assert data["total"] == sum(numel(s) for s in shapes.values()) == 8_030_261_248
    meta = cli.json("params", folder, "--meta-only")
    assert abs(meta["stored_bytes"] - data["stored_bytes"]) <= data["stored_bytes"] / 100


def test_table_shows_bits_and_bookkeeping(cli):
    result = cli("params", DATA / "w4a16")
    assert result.exit_code == 0, result.stderr
    out = " ".join(result.stdout.split())
    for said in ("bits/param", "stored as", "bookkeeping: scales (14 tensors)", "stored in all"):
        assert said in out, said
    assert "dtype ?" not in out


def test_unquantised_table_is_unchanged(cli, tiny):
    result = cli("params", tiny("llama-untied"))
    assert "bits/param" not in result.stdout and "bookkeeping" not in result.stdout


def test_towers_stored_in_a_causal_lm_checkpoint(cli, tmp_path, tiny_shapes):
    """A vision tower and an audio tower stored beside the language model are their own group
    and parts, not decoder blocks."""
    towers = {
        "model.vision_tower.blocks.0.attn.qkv.weight": (192, 64),
        "model.vision_tower.blocks.1.attn.qkv.weight": (192, 64),
        "model.multi_modal_projector.linear_1.weight": (64, 64),
        "model.audio_tower.layers.0.fc1.weight": (128, 64),
    }
    stored = quantise({**tiny_shapes, **towers}, lambda n, s: False, lambda n, s: [])
    folder = _layout(tmp_path / "towers", stored, TINY)
    data = cli.json("params", folder, "--per-block")
    vision = 2 * 192 * 64 + 64 * 64
    assert data["total"] == TINY_TOTAL + vision + 128 * 64
    parts = {p["name"]: p["params"] for p in data["parts"]}
    assert parts == {"vision": vision, "audio": 128 * 64}
    groups = {g["name"]: g["params"] for g in data["groups"]}
    assert groups["towers"] == vision + 128 * 64
    assert data["num_layers"] == 2 and [b["layer"] for b in data["blocks"]] == [0, 1]
    assert data["quantised"] is False and data["bookkeeping"] == []


def test_meta_only_says_where_it_cannot_price(cli, tmp_path, tiny_shapes):
    stored = quantise(tiny_shapes, lambda n, s: False, lambda n, s: [])
    quant = {"quant_method": "hqq", "nbits": 4}
    folder = _layout(tmp_path / "hqq", stored, {**TINY, "quantization_config": quant})
    result = cli("params", folder, "--meta-only", "--json")
    data = json.loads(result.stdout)
    assert data["total"] == TINY_TOTAL
    assert data["bookkeeping_bytes"] is None and data["stored_bytes"] is None
    assert "cannot price the bytes of quant_method 'hqq'" in " ".join(result.stderr.split())
