"""The plain transformers script `embedlens lens MODEL --text FILE` is benchmarked against.

Load with AutoModelForCausalLM, tokenise the text once, cut windows of CTX tokens (the BOS first
when the tokenizer adds one), run each with output_hidden_states=True, and at the second half's
positions decode every layer (final norm and head; the last layer: the model's logits): mean
cross-entropy against the next token, KL(output ‖ layer), entropy and top-1 accuracy per layer.
Usage: python bench/lens_text_plain.py MODEL TEXT MAX_TOKENS [CTX]
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

path, text_path, max_tokens = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
ctx = int(sys.argv[4]) if len(sys.argv) > 4 else 512
folder, name = (path.parent, path.name) if path.suffix == ".gguf" else (path, None)
tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
ids = tok(Path(text_path).read_text(encoding="utf-8"))["input_ids"][:max_tokens]
bos = tok.bos_token_id if tok("a")["input_ids"][:1] == [tok.bos_token_id] else None
pos = torch.arange(ctx // 2, ctx - 1)
sums: dict[int, list[float]] = {}
n = 0
with torch.inference_mode():
    for start in range(0, len(ids) - ctx + 1, ctx):
        w = list(ids[start : start + ctx])
        if bos is not None:
            w[0] = bos
        out = model(torch.tensor([w]), output_hidden_states=True)
        t = torch.tensor(w)[pos + 1]
        out_lp = out.logits[0, pos].float().log_softmax(-1)
        states = out.hidden_states
        for layer in range(len(states)):
            if layer < len(states) - 1:
                lp = model.lm_head(model.model.norm(states[layer][0, pos])).log_softmax(-1)
            else:
                lp = out_lp
            s = sums.setdefault(layer, [0.0, 0.0, 0.0, 0.0])
            s[0] += float(-lp.gather(1, t[:, None]).sum())
            s[1] += float((out_lp.exp() * (out_lp - lp)).sum())
            s[2] += float(-(lp.exp() * lp).sum())
            s[3] += float((lp.argmax(-1) == t).sum())
        n += len(pos)
print(json.dumps({layer: [x / n for x in s] for layer, s in sums.items()}))
