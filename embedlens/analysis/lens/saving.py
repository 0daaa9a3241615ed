"""`lens --save-states`: the residual stream of every layer at every position of the prompt run,
written in embedlens' states file (`states_file.save_states`) for `lens --states` to decode later,
on a machine that holds only the model's final norm and head."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from embedlens.analysis.lens.opening import Opened
    from embedlens.analysis.lens.options import Ask
    from embedlens.analysis.lens.prompt import Prompt


def save_run(
    path: str | os.PathLike[str], opened: Opened, run: Prompt, ask: Ask, revision: str | None
) -> None:
    """Run the prompt once more, keeping every layer at every position and the model's own
    logits at the last position, and write them to `path`."""
    import torch

    from embedlens.analysis.lens.blocks import find_blocks, hooked
    from embedlens.analysis.lens.capture import capture
    from embedlens.analysis.lens.states_file import save_states
    from embedlens.analysis.lens.threads import threads_for

    model = opened.model
    blocks = find_blocks(model)
    n_layers = len(blocks.modules)
    every = list(range(len(run.ids)))
    kept: list[torch.Tensor] = []

    def own_logits(_m: Any, _args: Any, out: Any) -> None:
        logits = out.logits if hasattr(out, "logits") else out[0]
        kept.append(logits[0, -1].detach().float().cpu())

    layers = list(range(n_layers + 1))
    with torch.inference_mode(), threads_for(model, len(run.ids)):
        with hooked([model.register_forward_hook(own_logits)]):
            cap = capture(model, blocks, [run.ids], [every], layers, masked=False, logits=False)
        residual = torch.stack([cap.residual[layer].cpu() for layer in layers], dim=1)
    about = {
        "model": opened.name,
        "revision": revision or "",
        "num_layers": str(n_layers),
        "prompt": run.text,
    }
    if ask.chat is not None:
        about["chat"] = ask.chat
    save_states(path, residual, run.ids, kept[-1] if kept else None, about)
