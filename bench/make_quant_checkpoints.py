"""Make the tiny compressed-tensors checkpoints under tests/data/quant/ (W4A16, W8A8, FP8_BLOCK,
NVFP4A16) from one tiny random Llama, with compressed-tensors' own quantisation and compressors.

Made with compressed-tensors 0.20.0, torch 2.13.0 (CPU) and transformers 5.24.0. llmcompressor
0.14 is not used: it pins other torch and transformers releases than embedlens tests, and its
one-shot path only computes the scales this script computes the same way (from each weight's
minimum and maximum, per the scheme's strategy: compressed-tensors' `calculate_qparams`).

    python bench/make_quant_checkpoints.py [OUT]   # default: tests/data/quant
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationConfig,
    QuantizationStrategy,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
from transformers import LlamaConfig, LlamaForCausalLM

SCHEMES = ("W4A16", "W8A8", "FP8_BLOCK", "NVFP4A16")
TINY = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
    "tie_word_embeddings": False, "dtype": "bfloat16",
}  # fmt: skip


def tiny_llama() -> LlamaForCausalLM:
    """The same random 2-layer Llama every time (seed 0), in bfloat16."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    return model.to(torch.bfloat16)


def _reduce(w: torch.Tensor, strategy: str, args) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of a weight over what each scale covers."""
    w = w.float()
    if strategy == QuantizationStrategy.TENSOR:
        return w.amin().reshape(1), w.amax().reshape(1)
    if strategy == QuantizationStrategy.CHANNEL:
        return w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    if strategy in (QuantizationStrategy.GROUP, QuantizationStrategy.TENSOR_GROUP):
        g = args.group_size
        grouped = w.reshape(w.shape[0], w.shape[1] // g, g)
        return grouped.amin(dim=2), grouped.amax(dim=2)
    if strategy == QuantizationStrategy.BLOCK:
        bo, bi = args.block_structure
        rows, cols = -(-w.shape[0] // bo), -(-w.shape[1] // bi)
        w = torch.nn.functional.pad(w, (0, cols * bi - w.shape[1], 0, rows * bo - w.shape[0]))
        blocks = w.reshape(rows, bo, cols, bi)
        return blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    raise ValueError(strategy)


def calibrate(model: torch.nn.Module) -> None:
    """Each quantised module's weight scales (and zero points, global scale) from its weight."""
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        args = scheme.weights
        low, high = _reduce(module.weight.data, args.strategy, args)
        global_scale = None
        if args.strategy == QuantizationStrategy.TENSOR_GROUP:
            global_scale = generate_gparam(
                module.weight.data.float().amin(), module.weight.data.float().amax()
            )
            module.weight_global_scale.data.copy_(global_scale)
        scale, zero = calculate_qparams(low, high, args, global_scale=global_scale)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))


def make(name: str, out: Path) -> None:
    """One checkpoint: the tiny Llama quantised by a preset scheme, compressed and saved."""
    model = tiny_llama()
    scheme = preset_name_to_scheme(name, ["Linear"])
    if scheme.weights.group_size == 128:  # W4A16's groups of 128 are wider than d = 64
        scheme.weights.group_size = 32
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        calibrate(model)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    folder = out / name.lower()
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    config_json = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    for extra in folder.glob("generation_config.json"):
        extra.unlink()


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/data/quant")
    out.mkdir(parents=True, exist_ok=True)
    for name in SCHEMES:
        make(name, out)


if __name__ == "__main__":
    main()
