"""The floor `embedlens lens MODEL --states A --against-states B` is benchmarked against.

Read the two folders' states files whole (safetensors), the model's final norm and head, and
decode every position of both sides once at each layer asked (RMSNorm, then the head): what any
comparison of the two runs' lenses must do at least. Nothing else: no KL, no statistics.
Usage: python bench/parity_plain.py MODEL_FOLDER A_DIR B_DIR LAYERS (comma-separated)
"""

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

folder, a_dir, b_dir = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
layers = [int(x) for x in sys.argv[4].split(",")]
config = json.loads((folder / "config.json").read_text())
eps = float(config.get("rms_norm_eps", 1e-6))
with safe_open(str(folder / "model.safetensors"), "pt") as f:
    norm = f.get_tensor("model.norm.weight").float()
    names = set(f.keys())
    head = f.get_tensor(
        "lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight"
    )
head = head.float()
total = 0.0
with torch.inference_mode():
    for path in sorted(a_dir.glob("*.safetensors")):
        for side in (path, b_dir / path.name):
            hidden = load_file(str(side))["hidden_states"]
            for layer in layers:
                h = hidden[:, layer].float()
                normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm
                total += float((normed @ head.T)[:, 0].sum())
print(total)
