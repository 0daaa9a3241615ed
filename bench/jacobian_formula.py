"""The Jacobian lens's exact fit against the formula, at every layer of SmolLM2.

`tune --jacobian`'s exact estimator (`fit_jacobian`) on two fixed prompts, every layer with a
matrix (0..28), against a plain-torch computation of the definition (tests/test_jacobian_fit.py's
`formula`: one autograd.grad per output dimension, 16 rows of each matrix): the relative
difference and cosine per layer. The test suite checks the last three layers (the backward
through four blocks); this runs the whole depth (about two minutes on two cores).
Usage: python bench/jacobian_formula.py SMOLLM2.gguf
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from embedlens.analysis.tune.jacobian import fit_jacobian
from embedlens.io.source import resolve
from embedlens.model import loading
from tests.test_jacobian_fit import _cosine, _mean, _relative, formula

PROMPTS = [
    [1, 504, 3458, 282, 4649, 314, 7042, 30, 378, 11126, 7706, 260],
    [504, 1380, 2114, 418, 253, 1345, 28, 357, 2730, 3807, 29],
]
model = loading.load_model(resolve(sys.argv[1]), dtype="float32")
layers = list(range(model.config.num_hidden_layers - 1))
start = time.perf_counter()
fit = fit_jacobian(model, PROMPTS, skip_first=4, dim_batch=96, layers=layers)
print(f"exact fit: {time.perf_counter() - start:.0f} s, {fit.backward_passes} backward passes")
dims = list(range(0, model.config.hidden_size, 37))
want = _mean([formula(model, ids, layers, 4, dims) for ids in PROMPTS])
worst = 0.0
for layer in layers:
    rel = _relative(fit.matrices[layer][dims], want[layer])
    worst = max(worst, rel)
    print(
        f"layer {layer:2d}: relative {rel:.2e}, cosine {_cosine(fit.matrices[layer][dims], want[layer]):.10f}"
    )
print(f"largest relative difference: {worst:.2e} (the criterion: 1e-4)")
