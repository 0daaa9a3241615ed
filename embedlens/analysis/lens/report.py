"""One prompt through the engine (`run_one`), and a lens run's result as the `LensReport` users
get (`lens_report`, `one_report`): tokens as text, rows, grid, check."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from embedlens.analysis.lens.opening import Prompt, target_note, token_text
from embedlens.analysis.lens.options import Ask, resolve_layers
from embedlens.reports.lens import (
    GridCell,
    GridRow,
    LensCheck,
    LensLayer,
    LensReport,
    LensTarget,
    Prediction,
    TargetAt,
)
from embedlens.reports.tokens import TokenRef

if TYPE_CHECKING:
    import torch
    from torch import nn

    from embedlens.analysis.lens.blocks import Decoder
    from embedlens.analysis.lens.engine import LensResult
    from embedlens.analysis.lens.opening import Opened


def lens_report(
    name: str,
    tokenizer: Any,
    model: nn.Module,
    result: LensResult,
    ask: Ask,
    prompt: Prompt,
    around: tuple[list[str], list[str]] = ([], []),
) -> LensReport:
    """The report of one prompt's run; its notes: the prompt's, `around[0]` (loading), the run's,
    `around[1]` (the model's code)."""
    cache: dict[int, str] = {}

    def tok(i: int) -> str:
        if i not in cache:
            cache[i] = token_text(tokenizer, i)
        return cache[i]

    c = result.check
    target_id = prompt.target_id
    hint = None
    if ask.target is not None:
        hint = target_note(prompt, ask.target, result.output_at(prompt.index), tok)
    return LensReport(
        model=name,
        tokens=[TokenRef(i, tok(i)) for i in prompt.ids],
        position=-1 if ask.position is None else ask.position,
        position_index=prompt.index,
        num_layers=result.num_layers,
        layers=_layer_rows(result, prompt.index, tok),
        check=LensCheck(c.max_abs_logit_diff, c.tolerance, c.ok, c.top1_agrees, c.suspect),
        steps=result.steps,
        dtype=dtype_name(model),
        vocab_size=result.vocab_size,
        tokenizer_size=len(tokenizer),
        prompt=prompt.text,
        chat=ask.chat,
        target=None
        if ask.target is None or target_id is None
        else LensTarget(text=ask.target, id=target_id, token=tok(target_id)),
        grid=_grid_rows(result, tok) if len(result.positions) > 1 or ask.position is None else None,
        placement=_placement(model),
        notes=[
            *prompt.notes,
            *([] if hint is None else [hint]),
            *around[0],
            *_notes(result, ask, prompt, model),
            *around[1],
        ],
    )


def dtype_name(model: nn.Module) -> str:
    """The dtype of the model's parameters, as reports name it ('float32')."""
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def _notes(result: LensResult, ask: Ask, prompt: Prompt, model: nn.Module) -> list[str]:
    """What the run itself has to say: -k past the vocabulary, the full tail, offloading."""
    notes: list[str] = []
    shown = len(result.rows[(result.layers[0], prompt.index)].ids)
    if ask.top_k > shown:
        notes.append(
            f"-k {ask.top_k} is more than the vocabulary's {shown:,} tokens: showing all {shown:,}"
        )
    if result.full_tail:
        notes.append("the model's tail could not run on its last block alone: it ran every block")
    placement = _placement(model)
    if placement is not None and "disk" in placement:
        notes.append("some weights are offloaded to disk: the run reads them back as it goes")
    return notes


def _layer_rows(result: LensResult, index: int, tok: Callable[[int], str]) -> list[LensLayer]:
    """One row per layer asked for, at the position read."""
    rows = []
    for layer in result.layers:
        top = result.rows[(layer, index)]
        at = None
        if (
            top.target_prob is not None
            and top.target_rank is not None
            and top.target_logprob is not None
        ):
            at = TargetAt(top.target_prob, top.target_rank, top.target_logprob)
        predictions = [
            Prediction(i, tok(i), p, lp)
            for i, p, lp in zip(top.ids, top.probs, top.logprobs, strict=True)
        ]
        rows.append(LensLayer(layer=layer, top=predictions, target=at, **top.stats))
    return rows


def _grid_rows(result: LensResult, tok: Callable[[int], str]) -> list[GridRow]:
    """The top-1 prediction at every layer and position."""

    def cell(layer: int, p: int) -> GridCell:
        top = result.rows[(layer, p)]
        return GridCell(p, top.ids[0], tok(top.ids[0]), top.probs[0], top.logprobs[0])

    return [
        GridRow(layer=layer, cells=[cell(layer, p) for p in sorted(result.positions)])
        for layer in result.layers
    ]


def _placement(model: nn.Module) -> dict[str, int] | None:
    """With a device map: how many placed modules went to each device."""
    device_map = getattr(model, "hf_device_map", None)
    if not isinstance(device_map, dict) or not device_map:
        return None
    placement: dict[str, int] = {}
    for where in device_map.values():
        placement[str(where)] = placement.get(str(where), 0) + 1
    return placement


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
    around = (opened.before, opened.after)
    return lens_report(opened.name, opened.tokenizer, opened.model, result, ask, run, around)
