"""The lens engine: capture the residual stream, decode it through a decoder, check the decoding.

`run_lens` is the engine on one prompt; `batch.BatchLens` feeds it many at once through the same
capture (`capture.capture`), the same chunked decoding (`decoded`), ranking (`ranking`) and
decoder. A self-check compares the decoding of the last block's output with the model's real
logits, and says which step is suspect if they differ.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from embedlens.analysis.lens.blocks import Blocks, find_blocks, input_device
from embedlens.analysis.lens.capture import capture
from embedlens.analysis.lens.decoder import Decoder, ModelDecoder
from embedlens.analysis.lens.ranking import Top, exact_top1, exact_tops
from embedlens.analysis.lens.threads import threads_for
from embedlens.errors import NumericError, UnsupportedError

CHUNK_BYTES = 256 * 2**20
"""Logits decoded at once by `run_lens` (float32 bytes): rows are decoded in chunks of at most
this size."""

Row = tuple[int, int]
"""(layer, row of the capture)."""


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
class LensResult:
    """Every (layer, position) asked for, decoded; the last layer is the model's own logits."""

    num_layers: int
    vocab_size: int
    """Rows of the model's output."""
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

    def output_at(self, position: int) -> torch.Tensor | None:
        """The model's own logits at one position read."""
        if self.output is None or position not in self.positions:
            return None
        return self.output[self.positions.index(position)]


def tolerance(dtype: torch.dtype, logits: torch.Tensor) -> float:
    """1e-3 in float32; in a 16-bit dtype, what its rounding allows at these logits' size."""
    if dtype in (torch.float32, torch.float64):
        return 1e-3
    scale = max(1.0, float(logits.abs().max()))
    return max(1e-3, 8 * torch.finfo(dtype).eps * scale)


def decoded(
    decoder: Decoder,
    residual: dict[int, torch.Tensor],
    order: Sequence[Row],
    chunk_bytes: int,
    vocab: int,
    device: torch.device,
) -> Iterator[tuple[list[Row], torch.Tensor]]:
    """The rows `order` through the decoder in chunks of at most `chunk_bytes` of float32 logits
    over `vocab` tokens: each chunk's rows and their logits [n, V], float32."""
    chunk = max(1, chunk_bytes // (4 * vocab))
    for start in range(0, len(order), chunk):
        part = list(order[start : start + chunk])
        h = torch.stack([residual[layer][r].to(device) for layer, r in part])
        yield part, decoder.logits(h, [layer for layer, _ in part]).float()


def run_lens(
    model: nn.Module,
    input_ids: Sequence[int],
    *,
    layers: Sequence[int],
    positions: Sequence[int],
    k: int,
    real_vocab: int,
    target: int | None = None,
    full_at: Sequence[int] | None = None,
    decoder: Decoder | None = None,
) -> LensResult:
    """Decode `layers` (0 = embedding output, L = the model's output) at `positions` of one prompt
    (indices into `input_ids`). `real_vocab` is the tokenizer's length: rows past it are padding,
    never predicted, though the softmax runs over every row. `full_at`: the positions whose rows
    hold the top-k and the target (all by default; the others hold their top-1 only, a grid's
    cells). `decoder`: the model's own by default."""
    blocks = find_blocks(model)
    n_layers = len(blocks.modules)
    bad = [x for x in layers if not 0 <= x <= n_layers]
    if bad:
        raise UnsupportedError(f"layer {bad[0]} does not exist: the model has {n_layers} blocks")
    device = input_device(model)
    pos = [int(p) for p in positions]
    if decoder is None:
        decoder = ModelDecoder(model, blocks, dummy_id=int(input_ids[0]))
    with torch.inference_mode(), threads_for(model, len(input_ids)):
        wanted = sorted(set(layers) | {n_layers})
        cap = capture(model, blocks, [input_ids], [pos], wanted, decoder.watch, masked=False)
        assert cap.logits is not None
        real = cap.logits
        if not bool(torch.isfinite(real).all()):
            raise _model_not_finite(model, blocks, input_ids, pos, real)
        vocab = int(real.shape[-1])
        if target is not None and not 0 <= target < vocab:
            raise UnsupportedError(f"token {target} has no row in the model's output ({vocab})")
        full = None if full_at is None else frozenset(int(p) for p in full_at)
        job = _OnePrompt(layers, n_layers, pos, k, min(real_vocab, vocab), target, real, full)
        rows, diff, agrees = job.decode(decoder, cap.residual, device)
        tol = tolerance(next(model.parameters()).dtype, real)
        if diff > tol and not decoder.full:  # cutting the block list may have changed the tail
            decoder.full = True
            retry = job.decode(decoder, cap.residual, device)
            if retry[1] < diff:
                rows, diff, agrees = retry
            else:
                decoder.full = False
        steps = decoder.steps(cap.residual[n_layers][0].to(device), tol)
        suspect = decoder.suspect(cap, tol) if diff > tol else None
    return LensResult(
        num_layers=n_layers,
        vocab_size=vocab,
        positions=pos,
        layers=sorted(set(layers)),
        rows=rows,
        check=Check(diff, tol, agrees, suspect),
        steps=steps,
        full_tail=decoder.full,
        output=real,
    )


@dataclass(frozen=True)
class _OnePrompt:
    """What to decode of one prompt, and how to reduce each row as soon as it is decoded."""

    layers: Sequence[int]
    n_layers: int
    pos: list[int]
    k: int
    real_vocab: int
    target: int | None
    real: torch.Tensor
    """The model's own logits at `pos`, float32 [P, V]."""
    full_at: frozenset[int] | None = None
    """Positions reduced to the top-k and the target (None: all); the others to their top-1."""

    def decode(
        self, decoder: Decoder, residual: dict[int, torch.Tensor], device: torch.device
    ) -> tuple[dict[tuple[int, int], Top], float, bool]:
        """Every (layer, position) reduced to its top-k, plus the self-check on the last block.

        Rows go through the decoder in chunks of bounded size and only their top-k is kept, so a
        layer x position grid never holds more than one chunk of logits.
        """
        wanted = sorted(set(self.layers) | {self.n_layers})
        order = [(layer, j) for layer in wanted for j in range(len(self.pos))]
        rows: dict[tuple[int, int], Top] = {}
        diff, agrees = 0.0, True
        vocab = int(self.real.shape[-1])
        for part, out in decoded(decoder, residual, order, CHUNK_BYTES, vocab, device):
            check_decoded(out, part, lambda j: self.pos[j])
            last = [i for i, (layer, _) in enumerate(part) if layer == self.n_layers]
            if last:
                mine = out[last]
                theirs = self.real[[part[i][1] for i in last]].to(mine.device)
                diff = max(diff, float((mine - theirs).abs().max()))
                agrees = agrees and bool((mine.argmax(-1) == theirs.argmax(-1)).all())
            keep = [i for i, (layer, _) in enumerate(part) if layer != self.n_layers]
            keep = [i for i in keep if part[i][0] in self.layers]
            if keep:
                where = [(part[i][0], self.pos[part[i][1]]) for i in keep]
                rows.update(self._reduce(where, out[keep]))
        if self.n_layers in self.layers:  # the last layer is the model's own output
            where = [(self.n_layers, p) for p in self.pos]
            rows.update(self._reduce(where, self.real))
        return rows, diff, agrees

    def _reduce(
        self, where: list[tuple[int, int]], logits: torch.Tensor
    ) -> dict[tuple[int, int], Top]:
        """Each (layer, position) row of `logits` reduced: to its top-k and target at the positions
        asked for in full, to its top-1 at the others."""
        asked = self.full_at
        full = [i for i, (_, p) in enumerate(where) if asked is None or p in asked]
        if len(full) == len(where):
            return dict(zip(where, self._top(logits), strict=True))
        out = dict(zip(where, exact_top1(logits, self.real_vocab), strict=True))
        if full:
            out.update(zip([where[i] for i in full], self._top(logits[full]), strict=True))
        return out

    def _top(self, logits: torch.Tensor) -> list[Top]:
        return exact_tops(logits, self.k, self.real_vocab, self.target)


def _kind(t: torch.Tensor) -> str:
    """'NaN' or 'infinite' (NaN first: it is the worse of the two)."""
    return "NaN" if bool(torch.isnan(t).any()) else "infinite"


def check_decoded(out: torch.Tensor, part: list[Row], position: Callable[[int], int]) -> None:
    """Refuse a decoded row that is not finite (the model's own logits were finite); `position`
    gives the prompt position of a capture row."""
    if bool(torch.isfinite(out.sum(-1)).all()):  # a NaN or an infinity makes its row's sum one
        return
    bad = ~torch.isfinite(out).all(-1)  # a sum of finite logits may overflow: look at each
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        layer, r = part[i]
        raise NumericError(
            f"decoding layer {layer} at position {position(r)} through the model's final steps "
            f"gives {_kind(out[i])} logits, though the model's own logits are finite: the lens "
            "cannot be read there",
            hint="in a 16-bit dtype the lens can overflow: try --dtype float32",
        )


def _model_not_finite(
    model: nn.Module, blocks: Blocks, ids: Sequence[int], pos: list[int], real: torch.Tensor
) -> NumericError:
    """Say where the model's own NaN or infinity starts: the first layer whose residual stream is
    not finite at the positions read, or the steps after the last block."""
    n_layers = len(blocks.modules)
    every = list(range(len(ids)))  # where it starts may be an earlier position
    watch = ModelDecoder(model, blocks, int(ids[0])).watch
    cap = capture(model, blocks, [ids], [every], list(range(n_layers + 1)), watch, masked=False)
    row = int((~torch.isfinite(real).all(-1)).nonzero()[0, 0])
    what = f"the model itself gives {_kind(real)} logits at position {pos[row]}"
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
    if next(model.parameters()).dtype in (torch.float16, torch.bfloat16):
        return "a 16-bit dtype can overflow: try --dtype float32"
    return "check the weights: a NaN or infinity in a tensor spreads to everything after it"
