"""One prompt through the engine, and the `LensReport` of its run."""

from __future__ import annotations

from typing import TYPE_CHECKING

from embedlens.analysis.lens.options import Ask, resolve_layers
from embedlens.analysis.lens.prompt import Prompt

if TYPE_CHECKING:
    import torch

    from embedlens.analysis.lens.blocks import Decoder
    from embedlens.analysis.lens.engine import LensResult
    from embedlens.analysis.lens.opening import Opened
    from embedlens.reports.lens import LensReport


def run_one(
    opened: Opened,
    ask: Ask,
    run: Prompt,
    *,
    keep: bool = False,
    other: dict[int, torch.Tensor] | None = None,
    decoder: Decoder | None = None,
) -> LensResult:
    """The engine on one prompt: the layers asked for at the position read (every position for
    the grid); `keep` and `other` as `engine.run_lens` takes them (a comparison); `decoder`: the
    model's own by default (a tuned lens's otherwise)."""
    from embedlens.analysis.lens.blocks import find_blocks
    from embedlens.analysis.lens.engine import run_lens

    model = opened.model
    return run_lens(
        model,
        run.ids,
        layers=resolve_layers(ask.layers, len(find_blocks(model).modules)),
        positions=list(range(len(run.ids))) if ask.grid else [run.index],
        k=ask.top_k,
        real_vocab=len(opened.tokenizer),
        target=run.target_id,
        full_at=[run.index],
        keep=keep,
        other=other,
        decoder=decoder,
    )


def one_report(opened: Opened, ask: Ask, run: Prompt, result: LensResult) -> LensReport:
    """The report of one prompt's run, with the notes of how the model came."""
    from embedlens.analysis.lens.report import lens_report

    around = (opened.before, opened.after)
    return lens_report(opened.name, opened.tokenizer, opened.model, result, ask, run, around)
