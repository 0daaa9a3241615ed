"""Re-make tests/data/jacobian/tl43_llama_tied.pt: a Jacobian lens fitted and saved by
TransformerLens 4.3 (`JacobianLens.fit`, `JacobianLens.save`) on the tests' tiny random
llama-tied model (tests/models.py, seed 0), which the tests rebuild bit for bit.

Runs in an environment holding transformer-lens==4.3.0 and this checkout's test helpers' needs
(torch, transformers, tokenizers), from the repository root:

    python bench/make_jacobian_fixture.py [OUT]

The model is booted from a folder named `llama-tied` (the working folder a temporary one), so
the artifact's recorded model_name is that name and no path of this machine. Besides TL's own
provenance, the metadata holds the fit's token ids (`token_ids`) and TransformerLens'
`readout` of the first prompt (the lens as saved, loaded back): per layer and position, its top-5 token ids (`readout_top5`)
and logits (`readout_top5_logits`), with the smallest gap between the 5th and 6th logits (`readout_min_gap`), so embedlens' tests
can check their own reading against it without TransformerLens.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "jacobian" / "tl43_llama_tied.pt"
SENTENCES = [
    "the king of France is in Paris and the queen of Germany is in Berlin the prince was in "
    "Rome the capital city of Italy",
    "a big red car is in the road and a small blue car is in the house the boy and the girl "
    "run to the water",
    "one cat two dogs three cats four dogs the sun and the moon the fire and the water the "
    "good book and the bad word",
]
SKIP, MAX_LEN, DIM_BATCH = 4, 24, 8


def main() -> None:
    import torch
    from transformer_lens.model_bridge import TransformerBridge
    from transformer_lens.tools.analysis import JacobianLens

    sys.path.insert(0, str(ROOT))
    from tests import models

    out = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    here = Path.cwd()
    with tempfile.TemporaryDirectory() as tmp:
        models.build("llama-tied", Path(tmp) / "llama-tied")
        os.chdir(tmp)
        try:
            bridge = TransformerBridge.boot_transformers(
                "llama-tied", device="cpu", dtype=torch.float32
            )
        finally:
            os.chdir(here)
        bridge.eval()
        ids = [bridge.to_tokens(s)[0, :MAX_LEN].tolist() for s in SENTENCES]
        lens = JacobianLens.fit(
            bridge,
            SENTENCES,
            corpus="tests/models.py WORDS, 3 sentences",
            dim_batch=DIM_BATCH,
            max_seq_len=MAX_LEN,
            skip_first_positions=SKIP,
            show_progress=False,
            metadata={"token_ids": ids},
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        lens.save(str(out))
        saved = JacobianLens.load(str(out))  # read with the matrices as saved (float16)
        read = saved.readout(bridge, torch.tensor([ids[0]]), top_k=6)
    values, indices = read.lens_topk_values, read.lens_topk_indices
    gap = min(float((values[k][:, 4] - values[k][:, 5]).min()) for k in values)
    lens.metadata["readout_top5"] = {str(k): indices[k][:, :5].tolist() for k in sorted(indices)}
    lens.metadata["readout_top5_logits"] = {
        str(k): values[k][:, :5].tolist() for k in sorted(values)
    }
    lens.metadata["readout_min_gap"] = gap
    lens.save(str(out))
    print(
        f"wrote {out} ({out.stat().st_size} bytes); model_name "
        f"{lens.metadata['model_name']!r}; smallest 5th-6th logit gap {gap:.3g}"
    )


if __name__ == "__main__":
    main()
