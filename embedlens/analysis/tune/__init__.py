"""Learned lenses: fit a tuned lens to any model, evaluate it, write it for `lens --tuned`.

One idea per module, read top-down from `api` (the function users call):

- `api`: what users ask for (files, token counts, the method, the refinement), checked
  before any model file is read, and the lens folder (tuned-lens's config keys and state-dict
  keys), written whole or not at all;
- `data`: the data file's documents, streamed, tokenised into sequences of equal length, and
  shared out (`plan_sequences`: fitted, refined on, checked, held out);
- `run`: one run on a model made ready: `fit` (the closed-form least-squares translators from
  streamed sufficient statistics), `refine`, `evaluate`;
- `reading`: the model as a run reads it: its blocks, its own decoder (self-checked), one
  forward pass per sequence;
- `refine`: tuned-lens's KL refinement (SGD with Nesterov momentum, weight decay toward the
  identity, linear decay);
- `evaluate`: the held-out table, logit lens against tuned lens, layer by layer.

The tuned lens itself, a decoder the lens engine runs (and `embedlens.TunedLens`), is
`embedlens.analysis.lens.decoders`; its folder is read, and matched to its model (what a lens
records of its model, and the checks that refuse it on another), in
`embedlens.analysis.lens.tuned_folder`.
"""

from embedlens.analysis.tune.api import tune

__all__ = ["tune"]
