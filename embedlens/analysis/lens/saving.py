"""`lens --save-states`: the residual stream of every layer at every position of a prompt run,
written in embedlens' states file (`states_file.save_states`) for `lens --states` to decode later,
on a machine that holds only the model's final norm and head.

One prompt: the file named. Many (`--prompts`): a folder, one file per prompt, named by its line
(`000001.safetensors` for line 1), written as the windows run; under torchrun the other ranks'
states are sent to rank 0 at each round's end, which alone writes (`ManySaver`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from embedlens.errors import EmbedlensError, UsageError

if TYPE_CHECKING:
    import torch

    from embedlens.analysis.dist import Session
    from embedlens.analysis.lens.opening import Opened
    from embedlens.analysis.lens.options import Ask
    from embedlens.analysis.lens.prompt import Prompt
    from embedlens.model.prompts import PromptLine

States = tuple["torch.Tensor", "torch.Tensor | None", dict[str, str]]
"""A prompt's residual [T, L+1, H], the model's logits at its last position, the metadata."""


def save_run(
    path: str | os.PathLike[str], opened: Opened, run: Prompt, ask: Ask, revision: str | None
) -> None:
    """Run the prompt once more, keeping every layer at every position and the model's own
    logits at the last position, and write them to `path`."""
    from embedlens.analysis.lens.states_file import save_states

    residual, logits, about = states_of(opened, run, ask, revision)
    save_states(path, residual, run.ids, logits, about)


def states_of(opened: Opened, run: Prompt, ask: Ask, revision: str | None) -> States:
    """The prompt run alone (as `lens` runs it, on the model's devices): every layer at every
    position, on the CPU, and the model's own logits at the last position."""
    import torch

    from embedlens.analysis.lens.blocks import capture, find_blocks, hooked
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
    return residual, kept[-1] if kept else None, about


def file_for(folder: Path, line: int) -> Path:
    """The file of the prompt on `line` in a --prompts run's folder."""
    return folder / f"{line:06d}.safetensors"


def states_folder(path: str | os.PathLike[str]) -> Path:
    """The folder --save-states names with --prompts, made if missing (refused: a file)."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise UsageError(
            f"--save-states '{folder}' is a file: with --prompts it names a folder, where each "
            "prompt's states go in a file of its own"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EmbedlensError(f"cannot make the folder '{folder}': {e.strerror or e}") from e
    return folder


class ManySaver:
    """`lens --prompts --save-states DIR`: each prompt's states, written to DIR as its window
    runs. Under torchrun (`keep`: a rank other than 0) they are kept until the round's end, then
    sent to rank 0 one prompt at a time, which writes them: rank 0 holds at most one prompt's
    states from each rank at once, each other rank its own window's."""

    def __init__(self, path: str | os.PathLike[str], opened: Opened, revision: str | None):
        self.folder = Path(path)  # made by `lens_prompts` (on rank 0)
        self.opened, self.revision = opened, revision
        self.kept: list[tuple[int, list[int], States]] = []
        self.keep = False

    def add(self, line: PromptLine, ask: Ask, run: Prompt) -> None:
        """One prompt's states: written now, or kept for rank 0 under torchrun."""
        states = states_of(self.opened, run, ask, self.revision)
        about = {**states[2], "line": str(line.line)}
        if line.id is not None:
            about["id"] = str(line.id)
        item = (line.line, run.ids, (states[0], states[1], about))
        if self.keep:
            self.kept.append(item)
        else:
            self._write(item)

    def hand_on(self, session: Session) -> None:
        """The states the other ranks kept this round, sent to rank 0 one prompt from each at
        a time and written there (every rank calls this)."""
        counts = session.all_gather(len(self.kept))
        for i in range(max(counts)):
            parts = session.gather(self.kept[i] if i < len(self.kept) else None)
            for item in parts or []:
                if item is not None:
                    self._write(item)
        self.kept.clear()

    def _write(self, item: tuple[int, list[int], States]) -> None:
        from embedlens.analysis.lens.states_file import save_states

        line, ids, (residual, logits, about) = item
        save_states(file_for(self.folder, line), residual, ids, logits, about)
