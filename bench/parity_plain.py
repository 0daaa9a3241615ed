"""The plain transformers script `embedlens lens MODEL --states A --against-states B` is
benchmarked against.

Load the model with AutoModelForCausalLM, read the two folders' states files whole
(safetensors), and decode every position of both sides once at each layer asked through the
model's final norm and head: what any comparison of the two runs' lenses must do at least.
Nothing else: no KL, no statistics.
Usage: python bench/parity_plain.py MODEL_FOLDER A_DIR B_DIR LAYERS (comma-separated)
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

folder, a_dir, b_dir = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
layers = [int(x) for x in sys.argv[4].split(",")]
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
norm, head = model.model.norm, model.get_output_embeddings()
total = 0.0
with torch.inference_mode():
    for path in sorted(a_dir.glob("*.safetensors")):
        for side in (path, b_dir / path.name):
            hidden = load_file(str(side))["hidden_states"]
            for layer in layers:
                h = hidden[:, layer].float()
                # block L's output goes through the final norm; an earlier layer's too (the lens)
                total += float(head(norm(h))[:, 0].sum())
print(total)
