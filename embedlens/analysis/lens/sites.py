"""Inside the block: the residual stream after attention (`resid_mid`) and what the attention and
the MLP each add to it (`attn_out`, `mlp_out`), found from the model and checked on every run.

No table per architecture: one forward pass hooks each block and its direct children (whatever
they are named), and the pieces are the children's outputs that add up. In a sequential block
the attention's piece `a` is the first child output such that the block's input plus `a` is what
a later child reads (`resid_mid`, the MLP's norm's input), and the MLP's piece `m` a later output
with `resid_mid + m` = the block's output; in a parallel block (GPT-NeoX, Phi, Cohere) no child
reads `x + a`, and `x + a + m` = the output. A piece is the output the block adds, after any norm
it applies first (Gemma 2's post-norms). A block whose output is not such a sum (a residual scale,
a norm after the add) is refused, with what did not add up.

The sites of one prompt decoded (`site_rows`): `resid_mid` through the lens; `attn_out` and
`mlp_out` two ways, directly (the piece alone through the final norm and head: direct logit
attribution) and as the change they make to the lens (the lens after the piece against the lens
before it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from embedlens.analysis.lens.blocks import (
    Blocks,
    Decoder,
    first_tensor,
    forward,
    hooked,
    input_device,
)
from embedlens.analysis.lens.engine import CHUNK_BYTES
from embedlens.analysis.lens.stats import Top, best, exact_top1, exact_tops, next_ids
from embedlens.errors import NumericError, UnsupportedError


@dataclass(frozen=True)
class Split:
    """How one block's output splits: which children's outputs are its pieces, and how closely
    the sums hold (max |Δ| over every position) against what float rounding allows."""

    parallel: bool
    attn: str
    mlp: str
    error: float
    tolerance: float


@dataclass
class Pieces:
    """One prompt's blocks taken apart, at the positions read: layer l (block l, 1-based) ->
    rows [P, d] of its input (`pre`), `attn`, `mid` (sequential blocks only), `mlp` and output
    (`post`), float32; and each block's `Split`."""

    pre: dict[int, torch.Tensor] = field(default_factory=dict)
    attn: dict[int, torch.Tensor] = field(default_factory=dict)
    mid: dict[int, torch.Tensor] = field(default_factory=dict)
    mlp: dict[int, torch.Tensor] = field(default_factory=dict)
    post: dict[int, torch.Tensor] = field(default_factory=dict)
    splits: dict[int, Split] = field(default_factory=dict)


@dataclass
class _Call:
    """One call of a block's direct child: its name, input and output (full tensors)."""

    name: str
    module: nn.Module
    inp: torch.Tensor | None
    out: torch.Tensor | None = None


def tolerance(dtype: torch.dtype, *tensors: torch.Tensor) -> float:
    """What float rounding allows a sum of these tensors to miss by: 16 ulps of the model's dtype
    at their largest magnitude (the model may add the same pieces in another order)."""
    scale = max([1e-30, *(float(t.abs().max()) for t in tensors)])
    return 16 * torch.finfo(dtype).eps * scale


def _input(args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """A module's input: its first positional tensor, else `hidden_states` or the first tensor
    keyword."""
    t = first_tensor(args) if args else None
    if t is None:
        t = kwargs.get("hidden_states")
    if t is None:
        t = next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
    return t if isinstance(t, torch.Tensor) else None


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float32 (inf when their shapes differ)."""
    if a.shape != b.shape:
        return math.inf
    return float((a.float() - b.float()).abs().max())


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """The same values (a tensor passed on as it is)."""
    return a is not None and b is not None and (a is b or (a.shape == b.shape and a.equal(b)))


def _name(calls: list[_Call], i: int) -> str:
    """The module a piece comes from: past modules that pass their input on unchanged (dropout
    at inference), the one whose output they pass on."""
    while _same(calls[i].inp, calls[i].out):
        j = next((k for k in range(i - 1, -1, -1) if _same(calls[k].out, calls[i].inp)), None)
        if j is None:
            break
        i = j
    return calls[i].name


def find_split(
    block: str, x: torch.Tensor, y: torch.Tensor, calls: list[_Call], dtype: torch.dtype
) -> tuple[Split, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The block's pieces (its `Split`, `resid_mid` or None, `attn_out`, `mlp_out`), found among
    its children's outputs that no later child reads as they are (those go on inside the block);
    refused when no pair adds up."""
    outs = [
        (i, c)
        for i, c in enumerate(calls)
        if c.out is not None
        and c.out.shape == y.shape
        and not any(_same(later.inp, c.out) for later in calls[i + 1 :])
    ]
    found = _sequential(x, y, calls, outs, dtype)
    if found is None:
        found = _parallel(x, y, calls, outs, dtype)
    if isinstance(found, tuple):
        return found
    raise UnsupportedError(
        f"{block}: its pieces do not add up to its output, so its sites would be decoded "
        f"wrongly: {found}; the block does something besides adding its attention's and its "
        "MLP's outputs to the residual stream (a residual scale, a norm after the add)",
        hint="--site resid (the block's output) still reads this model",
    )


Found = tuple[Split, torch.Tensor | None, torch.Tensor, torch.Tensor]


def _sequential(
    x: torch.Tensor,
    y: torch.Tensor,
    calls: list[_Call],
    outs: list[tuple[int, _Call]],
    dtype: torch.dtype,
) -> Found | str | None:
    """A sequential block's pieces; a str when `resid_mid` was found but no MLP piece completes
    the sum (what missed); None when no child reads `input + piece` (not sequential)."""
    for n, (i, a) in enumerate(outs):
        assert a.out is not None
        summed = x.float() + a.out.float()
        tol = tolerance(dtype, x, a.out)
        reader = next((c for c in calls[i + 1 :] if _reads(c, summed, tol)), None)
        if reader is None or reader.inp is None:
            continue
        mid, mid_err, attn = reader.inp, _close(reader.inp, summed), _name(calls, i)
        misses: list[tuple[float, float, str]] = []
        for j, m in outs[n + 1 :]:
            assert m.out is not None
            err, tol = _close(mid.float() + m.out.float(), y), tolerance(dtype, mid, m.out, y)
            if err <= tol:
                split = Split(False, attn, _name(calls, j), max(err, mid_err), tol)
                return split, mid, a.out, m.out
            misses.append((err, tol, _name(calls, j)))
        if not misses:
            return f"resid_mid (its input plus {attn}'s output) is followed by no piece"
        err, tol, name = min(misses)
        return (
            f"resid_mid (its input plus {attn}'s output, which {reader.name} reads) plus "
            f"{name}'s output misses its output by {err:.3g} (tolerance {tol:.3g})"
        )
    return None


def _reads(c: _Call, summed: torch.Tensor, tol: float) -> bool:
    return c.inp is not None and _close(c.inp, summed) <= tol


def _parallel(
    x: torch.Tensor,
    y: torch.Tensor,
    calls: list[_Call],
    outs: list[tuple[int, _Call]],
    dtype: torch.dtype,
) -> Found | str:
    """A parallel block's pieces (input + a + m = output); else what came closest."""
    best: tuple[float, str] = (math.inf, "none of its modules returns a tensor of its size")
    for n, (i, a) in enumerate(outs):
        for j, m in outs[n + 1 :]:
            assert a.out is not None and m.out is not None
            err = _close(x.float() + a.out.float() + m.out.float(), y)
            tol = tolerance(dtype, x, a.out, m.out, y)
            names = _name(calls, i), _name(calls, j)
            if err <= tol:
                return Split(True, *names, err, tol), None, a.out, m.out
            text = f"its input plus {names[0]}'s and {names[1]}'s outputs misses its output by "
            best = min(best, (err, text + f"{err:.3g} (tolerance {tol:.3g})"))
    sized = ", ".join(dict.fromkeys(c.name for _, c in outs)) or "none"
    return f"{best[1]} (the closest; modules of its size: {sized})"


def capture_pieces(
    model: nn.Module, blocks: Blocks, ids: Sequence[int], positions: Sequence[int]
) -> Pieces:
    """One forward pass of one prompt, each block taken apart and its sums checked at every
    position; the pieces kept at `positions`."""
    pieces = Pieces()
    dtype = next(model.parameters()).dtype
    pos = torch.tensor([int(p) for p in positions], dtype=torch.long)
    handles: list[Any] = []
    for b, block in enumerate(blocks.modules):
        handles += _block_hooks(b + 1, block, pieces, pos, dtype)
    ids_t = torch.tensor([list(ids)], dtype=torch.long, device=input_device(model))
    with torch.inference_mode(), hooked(handles):
        forward(model, ids_t, torch.tensor([len(ids) - 1]))
    return pieces


def _block_hooks(
    layer: int, block: nn.Module, pieces: Pieces, pos: torch.Tensor, dtype: torch.dtype
) -> list[Any]:
    """Hooks on block `layer` and on its direct children that fill `pieces` when it returns."""
    calls: list[_Call] = []
    seen: list[torch.Tensor] = []

    def enter(_m: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        calls.clear()
        seen[:] = [t] if (t := _input(args, kwargs)) is not None else []

    def leave(_m: nn.Module, _args: Any, out: Any) -> None:
        y = first_tensor(out)
        if y is None or not seen:
            raise UnsupportedError(f"block {layer} has no tensor input and output to take apart")
        name = f"block {layer} ({type(block).__name__})"
        split, mid, a, m = find_split(name, seen[0], y, calls, dtype)
        at = pos.to(y.device)
        pieces.splits[layer] = split
        pieces.pre[layer], pieces.post[layer] = seen[0][0, at].float(), y[0, at].float()
        pieces.attn[layer], pieces.mlp[layer] = a[0, at].float(), m[0, at].float()
        if mid is not None:
            pieces.mid[layer] = mid[0, at].float()
        calls.clear()

    handles = [
        block.register_forward_pre_hook(enter, with_kwargs=True),
        block.register_forward_hook(leave),
    ]
    for child_name, child in block.named_children():
        handles += _child_hooks(child_name, child, calls)
    return handles


def _child_hooks(name: str, child: nn.Module, calls: list[_Call]) -> list[Any]:
    """Hooks that note each call of `child` (its input, then its output) in `calls`."""

    def enter(m: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        calls.append(_Call(name, m, _input(args, kwargs)))

    def leave(m: nn.Module, _args: Any, out: Any) -> None:
        call = next((c for c in reversed(calls) if c.module is m and c.out is None), None)
        if call is not None:
            call.out = first_tensor(out)

    return [
        child.register_forward_pre_hook(enter, with_kwargs=True),
        child.register_forward_hook(leave),
    ]


def structure(splits: dict[int, Split]) -> tuple[str, str, str, float, float]:
    """The blocks' structure as a report says it: 'sequential' or 'parallel', the attention's
    and the MLP's modules (every name found, in order), the largest error and its tolerance."""
    kinds = dict.fromkeys("parallel" if s.parallel else "sequential" for s in splits.values())
    attn = dict.fromkeys(s.attn for s in splits.values())
    mlp = dict.fromkeys(s.mlp for s in splits.values())
    worst = max(splits.values(), key=lambda s: s.error / s.tolerance)
    return "/".join(kinds), ", ".join(attn), ", ".join(mlp), worst.error, worst.tolerance


def refuse_mid_in_parallel(splits: dict[int, Split], block_type: Callable[[int], str]) -> None:
    """resid_mid asked of a parallel block: refused with why."""
    parallel = [layer for layer, s in splits.items() if s.parallel]
    if not parallel:
        return
    layer = parallel[0]
    s = splits[layer]
    raise UnsupportedError(
        f"--site resid_mid does not exist in block {layer} ({block_type(layer)}): its attention "
        f"({s.attn}) and its MLP ({s.mlp}) both read the block's input, in parallel (output = "
        "input + attention + MLP), so no stream runs between them",
        hint="ask for --site attn_out,mlp_out (what each adds) or resid",
    )


Key = tuple[str, int]
"""(stream, layer): 'mid', 'attn', 'mlp' (the pieces), 'pre', 'post', 'pre+attn', 'pre+mlp'."""
PIECE = {"attn_out": "attn", "resid_mid": "mid", "mlp_out": "mlp"}


@dataclass(frozen=True)
class Change:
    """What a piece does to the lens at the position read: KL(after ‖ before) in nats, and the
    tokens whose log-probability rose the most (id, Δ log-probability, probability after)."""

    kl: float
    gained: list[tuple[int, float, float]]


@dataclass(frozen=True)
class SiteRows:
    """A prompt's sites decoded: (site, layer, position) -> the top-k at the position read (the
    top-1 elsewhere); (site, layer) -> a piece's change at the position read."""

    rows: dict[tuple[str, int, int], Top]
    changes: dict[tuple[str, int], Change]


@dataclass(frozen=True)
class SiteJob:
    """What to decode: the sites other than resid at `layers`, at `positions` (indices into the
    pieces' rows are their order), the one at `index` in full."""

    sites: Sequence[str]
    layers: Sequence[int]
    positions: Sequence[int]
    index: int
    k: int
    real_vocab: int
    target: int | None
    ids: Sequence[int] = ()
    """The prompt's ids (each row's next token)."""


def before_after(piece: str, layer: int, pieces: Pieces) -> tuple[Key, Key]:
    """The streams a piece's change is read between: attention from the block's input to
    resid_mid, the MLP from resid_mid to the output (in a parallel block, each from the input to
    the input plus the piece)."""
    if layer not in pieces.mid:
        return ("pre", layer), ("pre+" + piece, layer)
    if piece == "attn":
        return ("pre", layer), ("mid", layer)
    return ("mid", layer), ("post", layer)


def stream(key: Key, pieces: Pieces) -> torch.Tensor:
    """The rows [P, d] of one stream."""
    name, layer = key
    piece: dict[int, torch.Tensor] = getattr(pieces, name.removeprefix("pre+"))
    return pieces.pre[layer] + piece[layer] if name.startswith("pre+") else piece[layer]


def decode_sites(
    job: SiteJob, pieces: Pieces, decoder: Decoder, device: torch.device, vocab: int
) -> SiteRows:
    """Every site row of `job` through the decoder, in bounded chunks."""
    full = job.positions.index(job.index)
    wanted: list[tuple[Key, int]] = []
    for layer in job.layers:
        for site in job.sites:
            piece = PIECE[site]
            wanted += [((piece, layer), j) for j in range(len(job.positions))]
            if piece != "mid":
                for key in before_after(piece, layer, pieces):
                    if (key, full) not in wanted:
                        wanted.append((key, full))
    logits = dict(decoded_rows(decoder, pieces, wanted, device, vocab))
    rows: dict[tuple[str, int, int], Top] = {}
    changes: dict[tuple[str, int], Change] = {}
    for layer in job.layers:
        for site in job.sites:
            piece = PIECE[site]
            at = [logits[(piece, layer), j] for j in range(len(job.positions))]
            rows.update(_tops(job, site, layer, at))
            if piece != "mid":
                before, after = before_after(piece, layer, pieces)
                changes[(site, layer)] = change(
                    logits[before, full], logits[after, full], job.k, job.real_vocab
                )
    return SiteRows(rows, changes)


def _tops(
    job: SiteJob, site: str, layer: int, logits: list[torch.Tensor]
) -> dict[tuple[str, int, int], Top]:
    """One site's rows at one layer reduced: the position read to its top-k, the others to
    their top-1."""
    out: dict[tuple[str, int, int], Top] = {}
    x = torch.stack(logits)
    ones = exact_top1(x, job.real_vocab)
    for j, p in enumerate(job.positions):
        if p == job.index:
            nexts = next_ids(job.ids, [p])
            out[(site, layer, p)] = exact_tops(
                x[j : j + 1], job.k, job.real_vocab, job.target, nexts
            )[0]
        else:
            out[(site, layer, p)] = ones[j]
    return out


def change(before: torch.Tensor, after: torch.Tensor, k: int, real_vocab: int) -> Change:
    """KL(after ‖ before) over the whole output, and the k real tokens gained the most."""
    lb = torch.log_softmax(before.double(), -1)
    la = torch.log_softmax(after.double(), -1)
    kl = float((la.exp() * (la - lb)).sum())
    delta = (la - lb)[:real_vocab]
    ids = best(delta[None].float(), k)[0].tolist()
    return Change(max(kl, 0.0), [(i, float(delta[i]), float(la[i].exp())) for i in ids])


def decoded_rows(
    decoder: Decoder,
    pieces: Pieces,
    wanted: list[tuple[Key, int]],
    device: torch.device,
    vocab: int,
) -> Iterator[tuple[tuple[Key, int], torch.Tensor]]:
    """Each wanted (stream, row) decoded: float32 logits [V], in chunks of bounded size."""
    streams = {key: stream(key, pieces) for key in dict.fromkeys(k for k, _ in wanted)}
    chunk = max(1, CHUNK_BYTES // (4 * vocab))
    for start in range(0, len(wanted), chunk):
        part = wanted[start : start + chunk]
        h = torch.stack([streams[key][j] for key, j in part]).to(device)
        out = decoder.logits(h, [key[1] for key, _ in part]).float()
        _finite(out, part)
        yield from zip(part, out, strict=True)


def _finite(out: torch.Tensor, part: list[tuple[Key, int]]) -> None:
    """Refuse a decoded row that is not finite."""
    bad = ~torch.isfinite(out).all(-1)
    if bool(bad.any()):
        (name, layer), _ = part[int(bad.nonzero()[0, 0])]
        raise NumericError(
            f"decoding {name} of block {layer} through the model's final steps gives logits "
            "that are not finite: that site cannot be read",
            hint="in a 16-bit dtype the lens can overflow: try --dtype float32",
        )
