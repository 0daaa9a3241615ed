"""The logit lens: what each layer would predict if it were the last.

One idea per module, read top-down from `api` (the functions users call, and what a call was
given made into its option objects):

- `options`: what users ask for (layers, positions, -k, template variables, loading), checked
  before any file is read;
- `opening`: one way to get the model ready, from its files or as the caller loaded it, and the
  prompt as run (chat template, ids, target, position), checked against the model;
- `engine`: one runner for one prompt (`run_lens`) and for many in batches: capture, decoder,
  ranking and the self-check, with KL and entropy per row in a batch;
- `many`: one prompt through the engine (`run_one`); prompts files and lists: every line
  checked, then run a window at a time;
- `stats`: the best tokens by logit, every per-row statistic defined once, and the one
  accumulator they are summed in;
- `text`: `lens_text`, the lens over every scored token of a text, and --save-logits files
  (`text_run`: a window through the model(s), and the report; `text_stats`: the sums read out);
- `report`: a run's result (`LensResult`), and the `LensReport` users get of it;
- `against`, `pairing`: `--against` (B checked, both run, the figures and reports);
- `sites`, `site_report`: `--site` (the pieces inside a block found, checked and decoded; the
  reports of one prompt, many, a pair);
- `states`: `lens_states`, the lens on hidden states a file holds (vLLM's, or `lens
  --save-states`'s: `states_file` reads and writes them), decoded by the model's tail alone;
- `parity`, `parity_run`, `parity_sources`: `lens_parity`, two runs of the same weights (saved
  states, or a model in two precisions) compared layer by layer and at the output;
- `decoders`: the decoders as public objects (`LogitLens`, `TunedLens`, the latter's folder read
  and matched to its model in `tuned_folder`), and the model's tail without its blocks
  (`open_tail`) that decodes saved states;
- `blocks`: the engine's parts (the model's block list, one forward pass that keeps the
  residual stream, what turns a residual into logits, CPU threads).
"""

from embedlens.analysis.lens.api import lens, lens_prompts
from embedlens.analysis.lens.options import DEVICE_MAPS
from embedlens.analysis.lens.parity_run import lens_parity
from embedlens.analysis.lens.states import lens_states
from embedlens.analysis.lens.text import lens_text

__all__ = ["DEVICE_MAPS", "lens", "lens_parity", "lens_prompts", "lens_states", "lens_text"]
