"""The lens engine: capture the residual stream, decode it through a decoder, check the decoding.

`run_lens` is the engine on one prompt; `batch.BatchLens` feeds it many at once through the same
capture (`capture.capture`), the same chunked decoding (`decoded`), ranking (`ranking`) and
decoder. A self-check compares the decoding of the last block's output with the model's real
logits, and says which step is suspect if they differ.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import nn

from embedlens.analysis.lens.blocks import (
    Blocks,
    Decoder,
    ModelDecoder,
    capture,
    find_blocks,
    input_device,
    threads_for,
)
from embedlens.analysis.lens.ranking import Top, exact_top1, exact_tops
from embedlens.analysis.lens.stats import next_ids
from embedlens.errors import NumericError, UnsupportedError

CHUNK_BYTES = 256 * 2**20
"""Logits decoded at once by `run_lens` (float32 bytes): rows are decoded in chunks of at most
this size."""

Row = tuple[int, int]
"""(layer, row of the capture)."""
K = TypeVar("K")


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
        yield part, decode_rows(decoder, residual, part, device)


def decode_rows(
    decoder: Decoder, residual: dict[int, torch.Tensor], part: Sequence[Row], device: torch.device
) -> torch.Tensor:
    """The rows `part` of `residual` through the decoder at once: float32 logits [n, V]. The
    same rows in the same chunk give the same bits: a comparison decodes another model's rows
    in the chunks of this one's."""
    h = torch.stack([residual[layer][r].to(device) for layer, r in part])
    return decoder.logits(h, [layer for layer, _ in part]).float()


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
    keep: bool = False,
    other: dict[int, torch.Tensor] | None = None,
) -> LensResult:
    """Decode `layers` (0 = embedding output, L = the model's output) at `positions` of one prompt:
    absolute indices into `input_ids`. `real_vocab` is the tokenizer's length: rows
    past it are padding and never predicted, though the softmax runs over every row. `full_at`:
    the positions whose rows hold the top-k and the target (all by default); the others hold
    their top-1 only (a grid's cells), whatever k is. `decoder`: the model's own by default.
    `keep`: the result keeps what a comparison needs (`Kept`), with `other` (another model's
    residual at the same layers and positions, layer -> [P, d]) through this decoder.
    """
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
        _refuse(model, blocks, input_ids, pos, real, target)
        vocab = int(real.shape[-1])
        full = None if full_at is None else frozenset(int(p) for p in full_at)
        job = _OnePrompt(
            layers, n_layers, pos, k, min(real_vocab, vocab), target, real, full, input_ids
        )
        keeping = None if not keep else _Keeping(other or {})
        tol = tolerance(next(model.parameters()).dtype, real)
        rows, diff, agrees, kept = _decode_checked(job, decoder, cap.residual, device, keeping, tol)
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
        kept=None if kept is None else Kept(kept.logits, kept.other, _at(cap.residual, wanted)),
    )


def _refuse(
    model: nn.Module,
    blocks: Blocks,
    input_ids: Sequence[int],
    pos: list[int],
    real: torch.Tensor,
    target: int | None,
) -> None:
    """Refuse the model's own logits when not finite (saying where), and a target with no row
    in the model's output."""
    if not bool(torch.isfinite(real).all()):
        raise _model_not_finite(model, blocks, input_ids, pos, real)
    vocab = int(real.shape[-1])
    if target is not None and not 0 <= target < vocab:
        raise UnsupportedError(f"token {target} has no row in the model's output ({vocab})")


def _decode_checked(
    job: _OnePrompt,
    decoder: Decoder,
    residual: dict[int, torch.Tensor],
    device: torch.device,
    keeping: _Keeping | None,
    tol: float,
) -> tuple[dict[tuple[int, int], Top], float, bool, _Keeping | None]:
    """`job.decode`, and once more with every block in place when the last block's decoding
    misses the model's logits (cutting the block list may have changed the tail): the closer of
    the two is kept."""
    first = job.decode(decoder, residual, device, keeping)
    if not first[1] > tol or decoder.full:  # a NaN difference is not retried
        return first
    decoder.full = True
    retry = job.decode(decoder, residual, device, keeping)
    if retry[1] < first[1]:
        return retry
    decoder.full = False
    return first


def _at(residual: dict[int, torch.Tensor], layers: Sequence[int]) -> dict[int, torch.Tensor]:
    return {layer: residual[layer] for layer in layers}


@dataclass
class _Keeping:
    """The rows one decoding keeps for a comparison (a retry starts afresh)."""

    other_residual: dict[int, torch.Tensor]
    logits: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    other: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def fresh(self) -> _Keeping:
        return _Keeping(self.other_residual)


def kept_rows(
    decoder: Decoder,
    part: list[Row],
    out: torch.Tensor,
    keys: Sequence[K | None],
    other: dict[int, torch.Tensor] | None,
    device: torch.device,
) -> tuple[list[tuple[K, torch.Tensor]], list[tuple[K, torch.Tensor]]]:
    """A decoded chunk's rows whose key is not None (copied unless every row is kept: the chunk
    itself is let go), and the other model's residual at the same rows through the same decoder
    in the same chunk."""
    at = [(i, k) for i, k in enumerate(keys) if k is not None]
    if not at:
        return [], []
    index = [i for i, _ in at]
    every = len(index) == len(out)  # `at` is in order: every row is row j
    mine = out if every else out[index]
    own = [(k, mine[j]) for j, (_, k) in enumerate(at)]
    if not other:
        return own, []
    theirs = decode_rows(decoder, other, part, device)
    theirs = theirs if every else theirs[index]
    return own, [(k, theirs[j]) for j, (_, k) in enumerate(at)]


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
    ids: Sequence[int] = ()
    """The prompt's ids (each row's next token)."""

    def decode(
        self,
        decoder: Decoder,
        residual: dict[int, torch.Tensor],
        device: torch.device,
        keeping: _Keeping | None = None,
    ) -> tuple[dict[tuple[int, int], Top], float, bool, _Keeping | None]:
        """Every (layer, position) reduced to its top-k, plus the self-check on the last block;
        with `keeping`, the rows at the positions read in full kept too.

        Rows go through the decoder in chunks of bounded size and only their top-k is kept, so a
        layer x position grid never holds more than one chunk of logits.
        """
        wanted = sorted(set(self.layers) | {self.n_layers})
        order = [(layer, j) for layer in wanted for j in range(len(self.pos))]
        rows: dict[tuple[int, int], Top] = {}
        diff, agrees = 0.0, True
        vocab = int(self.real.shape[-1])
        kept = None if keeping is None else keeping.fresh()
        for part, out in decoded(decoder, residual, order, CHUNK_BYTES, vocab, device):
            check_decoded(out, part, lambda j: self.pos[j])
            if kept is not None:
                keys = [self._kept_at(row) for row in part]
                own, other = kept_rows(decoder, part, out, keys, kept.other_residual, device)
                kept.logits.update(own)
                kept.other.update(other)
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
        return rows, diff, agrees, kept

    def _kept_at(self, row: Row) -> tuple[int, int] | None:
        """The (layer, position) a comparison keeps of a decoded row: a layer asked for (or the
        last) at a position read in full."""
        layer, j = row
        p = self.pos[j]
        return (layer, p) if self.full_at is None or p in self.full_at else None

    def _reduce(
        self, where: list[tuple[int, int]], logits: torch.Tensor
    ) -> dict[tuple[int, int], Top]:
        """Each (layer, position) row of `logits` reduced: to its top-k and target at the positions
        asked for in full, to its top-1 at the others."""
        asked = self.full_at
        full = [i for i, (_, p) in enumerate(where) if asked is None or p in asked]
        if len(full) == len(where):
            return dict(zip(where, self._top(logits, where), strict=True))
        out = dict(zip(where, exact_top1(logits, self.real_vocab), strict=True))
        if full:
            at = [where[i] for i in full]
            out.update(zip(at, self._top(logits[full], at), strict=True))
        return out

    def _top(self, logits: torch.Tensor, where: list[tuple[int, int]]) -> list[Top]:
        nexts = next_ids(self.ids, [p for _, p in where])
        return exact_tops(logits, self.k, self.real_vocab, self.target, nexts)


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
