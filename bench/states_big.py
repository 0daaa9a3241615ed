"""The `lens --states` memory row: a model of Llama-3-70B's shape (hidden 8,192, vocabulary
128,256, 80 blocks) whose checkpoint holds only what decoding needs, the final norm and a random
bfloat16 head (2.1 GB), and a states file of a few positions in embedlens' layout. Decoding it
must hold no more than the head and the norm plus 10%: the blocks are never read (they are not
even on disk). Quick mode (CI) builds the same on a small shape."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = HERE.parent / "tests" / "configs"
TAIL_NAMES = ("model.norm.weight", "lm_head.weight")

# The floor: torch, transformers and the model's class imported (as `lens` needs them), and the
# norm and the head read from the checkpoint with safetensors and gone through once (summed in
# slices), so that all their bytes are in memory; nothing else.
READ_TAIL_PLAIN = """
import sys, torch
from safetensors import safe_open
import transformers.models.llama.modeling_llama
with safe_open(sys.argv[1] + "/model.safetensors", framework="pt") as fh:
    kept = [fh.get_tensor(k) for k in ("model.norm.weight", "lm_head.weight")]
    sums = [float(t[i : i + 4096].float().sum()) for t in kept for i in range(0, len(t), 4096)]
"""


def big_paths(
    quick: bool, *, build: bool, cache: Path, tokenizer: Callable[[Path, int], None]
) -> tuple[Path, Path]:
    """The tail-only folder and its states file (small in quick mode), built on first use."""
    folder = cache / ("tail-only-tiny" if quick else "tail-only-llama3-70b")
    states = cache / (folder.name + ".states.safetensors")
    if build:
        make_states(states, make_tail_only(folder, quick, tokenizer))
    return folder, states


def big_config(quick: bool) -> dict[str, object]:
    """Llama-3-70B's config (a small one of its kind in quick mode)."""
    config: dict[str, object] = json.loads((CONFIGS / "Meta-Llama-3-70B.json").read_text())
    if quick:
        config.update(
            hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=8192, bos_token_id=1, eos_token_id=1,
        )  # fmt: skip
    return config


def tail_bytes(folder: Path) -> int:
    """The bytes of the norm and the head in the checkpoint."""
    with open(folder / "model.safetensors", "rb") as fh:
        header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
    return sum(header[k]["data_offsets"][1] - header[k]["data_offsets"][0] for k in TAIL_NAMES)


def make_tail_only(folder: Path, quick: bool, tokenizer: Callable[[Path, int], None]) -> Path:
    """config.json, a word tokenizer and model.safetensors holding only the final norm (ones) and
    a random head (normal, std 0.02, rounded to bfloat16), written in chunks: the blocks' and
    the embedding's tensors are not in the file. `tokenizer(folder, n)` writes n words'."""
    import numpy as np

    if (folder / "model.safetensors").is_file():
        return folder
    config = big_config(quick)
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])  # type: ignore[call-overload]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    shapes = {"model.norm.weight": [hidden], "lm_head.weight": [vocab, hidden]}
    header: dict[str, object] = {}
    offset = 0
    for name, shape in shapes.items():
        nbytes = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(0)
    tmp = folder / "model.safetensors.partial"
    with open(tmp, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little") + raw)
        fh.write((np.ones(hidden, np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes())
        n = vocab * hidden
        for start in range(0, n, 1 << 24):
            chunk = rng.standard_normal(min(1 << 24, n - start), dtype=np.float32) * 0.02
            fh.write((chunk.view(np.uint32) >> 16).astype(np.uint16).tobytes())
    tmp.rename(folder / "model.safetensors")
    tokenizer(folder, min(vocab, 32000))
    return folder


def make_states(path: Path, folder: Path, n_tokens: int = 4) -> Path:
    """embedlens' states file for the model in `folder`: every layer (0..80) at `n_tokens`
    positions, random bfloat16 states of the model's width, no logits (so no self-check)."""
    import torch

    from embedlens.analysis.lens.states_file import save_states

    if path.is_file():
        return path
    config = json.loads((folder / "config.json").read_text())
    layers, hidden = config["num_hidden_layers"] + 1, config["hidden_size"]
    gen = torch.Generator().manual_seed(0)
    residual = torch.randn(n_tokens, layers, hidden, generator=gen).to(torch.bfloat16)
    about = {"model": folder.name, "revision": "", "num_layers": str(layers - 1)}
    save_states(path, residual, list(range(10, 10 + n_tokens)), None, about)
    return path
