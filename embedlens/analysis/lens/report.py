"""A lens run's result (`LensResult`: its rows, its self-check, what a comparison keeps, picked
from each decoded chunk by `kept_rows`), the refusal of a model whose own logits are not finite,
and a result as the `LensReport` users get (`lens_report`, `one_report`): tokens as text, rows,
grid, check."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from embedlens.analysis.lens.opening import Prompt, target_note
from embedlens.analysis.lens.options import Ask
from embedlens.errors import NumericError
from embedlens.model.tokens import id_text
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

K = TypeVar("K")

if TYPE_CHECKING:
    import torch
    from torch import nn

    from embedlens.analysis.lens.blocks import Blocks
    from embedlens.analysis.lens.opening import Opened
    from embedlens.analysis.lens.stats import Top


@dataclass(frozen=True)
class Check:
    """Decoding the last block's output vs the model's own logits."""

    max_abs_logit_diff: float
    tolerance: float
    top1_agrees: bool
    suspect: str | None
    """None when the check passes; else the step that does not reproduce the model."""

    @property
    def ok(self) -> bool:
        """Whether the lens reproduced the model within tolerance (never for a NaN difference)."""
        return math.isfinite(self.max_abs_logit_diff) and self.max_abs_logit_diff <= self.tolerance


@dataclass(frozen=True)
class Kept:
    """What a run keeps to be compared with another model's (`keep=True`), at the positions read
    in full: float32 logits [V] by (layer, position) through this run's decoder (the last layer's
    too: the decoding of the last block's output, beside the model's own `output`); the other
    model's residual through the same decoder, in the same chunks as this run's own rows (`other`,
    empty unless given); and the residual stream the run captured, layer -> [positions, d]."""

    logits: dict[tuple[int, int], torch.Tensor]
    other: dict[tuple[int, int], torch.Tensor]
    residual: dict[int, torch.Tensor]


@dataclass(frozen=True)
class LensResult:
    """Every (layer, position) asked for, decoded; the last layer is the model's own logits."""

    num_layers: int
    vocab_size: int
    """Rows of the model's output."""
    real_vocab: int
    """The tokenizer's length: rows at or past it are padding, never ranked."""
    positions: list[int]
    layers: list[int]
    rows: dict[tuple[int, int], Top]
    """(layer, position) -> predictions."""
    check: Check
    steps: list[str]
    """What runs after the last block, in order: modules by name, then post-head steps."""
    full_tail: bool
    """True when the tail had to run with every block in place (cutting the list failed)."""
    output: torch.Tensor | None = None
    """The model's own logits at `positions`, float32 [P, V] (a view of the run's)."""
    kept: Kept | None = None
    """With `keep`: what a comparison with another model needs."""

    def output_at(self, position: int) -> torch.Tensor | None:
        """The model's own logits at one position read."""
        if self.output is None or position not in self.positions:
            return None
        return self.output[self.positions.index(position)]


def kept_rows(
    keys: Sequence[K | None], out: torch.Tensor, theirs: torch.Tensor | None = None
) -> tuple[list[tuple[K, torch.Tensor]], list[tuple[K, torch.Tensor]]]:
    """A decoded chunk's rows whose key is not None (copied unless every row is kept: the chunk
    itself is let go), and the same rows of `theirs` (the other model's residual decoded in the
    same chunk through the same decoder)."""
    at = [(i, k) for i, k in enumerate(keys) if k is not None]
    index = [i for i, _ in at]
    every = len(index) == len(out)  # `at` is in order: every row is row j
    mine = out if every else out[index]
    own = [(k, mine[j]) for j, (_, k) in enumerate(at)]
    if theirs is None:
        return own, []
    theirs = theirs if every else theirs[index]
    return own, [(k, theirs[j]) for j, (_, k) in enumerate(at)]


def not_finite(t: torch.Tensor) -> str:
    """'NaN' or 'infinite' (NaN first: it is the worse of the two)."""
    return "NaN" if bool(t.isnan().any()) else "infinite"


def model_not_finite(
    model: nn.Module, blocks: Blocks, ids: Sequence[int], pos: list[int], real: torch.Tensor
) -> NumericError:
    """Say where the model's own NaN or infinity starts: the first layer whose residual stream is
    not finite at the positions read, or the steps after the last block."""
    from embedlens.analysis.lens.blocks import ModelDecoder, capture

    n_layers = len(blocks.modules)
    every = list(range(len(ids)))  # where it starts may be an earlier position
    watch = ModelDecoder(model, blocks, int(ids[0])).watch
    cap = capture(model, blocks, [ids], [every], list(range(n_layers + 1)), watch, masked=False)
    row = int((~real.isfinite().all(-1)).nonzero()[0, 0])
    what = f"the model itself gives {not_finite(real)} logits at position {pos[row]}"
    first = next(
        (layer for layer in range(n_layers + 1) if not bool(cap.residual[layer].isfinite().all())),
        None,
    )
    if first == 0:
        where = "its embedding output (layer 0) is already not finite"
    elif first is not None:
        where = f"its residual stream is not finite from layer {first} on (block {first}'s output)"
    elif cap.head_in is not None and not bool(cap.head_in.isfinite().all()):
        where = "every block's output is finite; the steps between the last block and the head "
        where += "(the final norm) are not"
    elif cap.head_out is not None and not bool(cap.head_out.isfinite().all()):
        where = "every block's output and the head's input are finite; the head's output is not"
    else:
        where = "every block's output is finite; the steps after the last block are not"
    return NumericError(f"{what}: {where}. No layer can be read from it", hint=_hint(model))


def _hint(model: nn.Module) -> str:
    """16-bit dtypes overflow; in float32, the weights are the likely cause."""
    import torch

    if next(model.parameters()).dtype in (torch.float16, torch.bfloat16):
        return "a 16-bit dtype can overflow: try --dtype float32"
    return "check the weights: a NaN or infinity in a tensor spreads to everything after it"


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
            cache[i] = id_text(tokenizer, i)
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
        tokenizer_size=result.real_vocab,
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


def one_report(opened: Opened, ask: Ask, run: Prompt, result: LensResult) -> LensReport:
    """The report of one prompt's run, with the notes of how the model came."""
    around = (opened.before, opened.after)
    return lens_report(opened.name, opened.tokenizer, opened.model, result, ask, run, around)
