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

The sites decoded (`Reader`, the rows `Reader.rows` lists for every mode): `resid_mid` through the
lens; `attn_out` and `mlp_out` directly (the piece alone through the final norm and head:
direct logit attribution) and as the change they make to the lens (the lens after the piece
against the lens before it); one prompt's rows reduced (`decode_sites`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from embedlens.analysis.lens.blocks import (
    Blocks,
    Decoder,
    find_blocks,
    first_tensor,
    forward,
    hooked,
    input_device,
    threads_for,
)
from embedlens.analysis.lens.engine import CHUNK_BYTES
from embedlens.analysis.lens.stats import Top, best, exact_top1, exact_tops, next_ids
from embedlens.errors import NumericError, UnsupportedError

if TYPE_CHECKING:
    from embedlens.analysis.lens.opening import Prompt
    from embedlens.analysis.lens.report import LensResult


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


Found = tuple[Split, torch.Tensor | None, torch.Tensor, torch.Tensor]
"""A block's `Split`, its `resid_mid` (None in a parallel block), `attn_out` and `mlp_out`."""


def find_split(
    block: str, x: torch.Tensor, y: torch.Tensor, calls: list[_Call], dtype: torch.dtype
) -> Found:
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
        readers = (c for c in calls[i + 1 :] if c.inp is not None and _close(c.inp, summed) <= tol)
        reader = next(readers, None)
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


def take_apart(model: nn.Module, ids: Sequence[int], positions: Sequence[int], mid: bool) -> Pieces:
    """The model's blocks taken apart on one prompt (refused where the sums fail, or resid_mid
    of a parallel block when `mid`)."""
    blocks = find_blocks(model)
    with threads_for(model, len(ids)):  # as the engine's pass: the same bytes on any threads
        pieces = capture_pieces(model, blocks, ids, positions)
    parallel = [layer for layer, s in pieces.splits.items() if s.parallel]
    if not mid or not parallel:
        return pieces
    layer = parallel[0]
    s = pieces.splits[layer]
    raise UnsupportedError(
        f"--site resid_mid does not exist in block {layer} "
        f"({type(blocks.modules[layer - 1]).__name__}): its attention ({s.attn}) and its MLP "
        f"({s.mlp}) both read the block's input, in parallel (output = input + attention + "
        "MLP), so no stream runs between them",
        hint="ask for --site attn_out,mlp_out (what each adds) or resid",
    )


PIECE = {"attn_out": "attn", "resid_mid": "mid", "mlp_out": "mlp", "resid": "post"}
"""The stream each site's rows decode (a piece, or resid's: the block's output), in block order."""
Key = tuple[str, int]
"""(stream, layer): 'mid', 'attn', 'mlp' (the pieces), 'pre', 'post', 'pre+attn', 'pre+mlp'."""


def before_after(site: str, layer: int, pieces: Pieces) -> tuple[Key, ...]:
    """The streams a piece's change is read between: attention from the block's input to
    resid_mid, the MLP from resid_mid to the output (in a parallel block, each from the input to
    the input plus the piece); none for resid_mid and resid."""
    if site not in ("attn_out", "mlp_out"):
        return ()
    piece = PIECE[site]
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


@dataclass(frozen=True)
class Reader:
    """A prompt's blocks taken apart (a model's, or a states file's) and what decodes their rows:
    `decoder`, on `device`, into logits over `vocab` ids."""

    pieces: Pieces
    decoder: Decoder
    device: torch.device
    vocab: int

    def decoded(
        self, rows: list[tuple[Key, int]]
    ) -> Iterator[tuple[tuple[Key, int], torch.Tensor]]:
        """Each (stream, row) of `rows` decoded: float32 logits [V], in chunks of bounded size."""
        streams = {key: stream(key, self.pieces) for key in dict.fromkeys(k for k, _ in rows)}
        chunk = max(1, CHUNK_BYTES // (4 * self.vocab))
        for start in range(0, len(rows), chunk):
            part = rows[start : start + chunk]
            h = torch.stack([streams[key][j] for key, j in part]).to(self.device)
            out = self.decoder.logits(h, [key[1] for key, _ in part]).float()
            bad = ~torch.isfinite(out).all(-1)
            if bool(bad.any()):
                (name, layer), _ = part[int(bad.nonzero()[0, 0])]
                raise NumericError(
                    f"decoding {name} of block {layer} through the model's final steps gives "
                    "logits that are not finite: that site cannot be read",
                    hint="in a 16-bit dtype the lens can overflow: try --dtype float32",
                )
            yield from zip(part, out, strict=True)

    def rows(
        self, sites: Sequence[str], layers: Iterable[int], n: int, changes: Sequence[int]
    ) -> list[tuple[Key, int]]:
        """The rows to decode, in order: at each layer, the stream of every site at each of the
        `n` positions, then the streams a piece's change is read between (those not read
        already) at the positions `changes`."""
        out: list[tuple[Key, int]] = []
        for layer in layers:
            keys = [(PIECE[s], layer) for s in sites]
            moves = (k for s in sites for k in before_after(s, layer, self.pieces))
            out += [(key, j) for key in keys for j in range(n)]
            out += [(key, j) for key in dict.fromkeys(moves) if key not in keys for j in changes]
        return out

    def sites(
        self, sites: Sequence[str], layers: Sequence[int], n: int, changes: Sequence[int]
    ) -> Iterator[tuple[str, int, torch.Tensor, list[torch.Tensor]]]:
        """Each (layer, site) of `sites` at `layers` decoded (the rows `rows` lists, at once):
        the site, the layer, its rows [n, V] at the `n` positions, and those its change is read
        between (before, after: [C, V] at the positions `changes`; none for resid_mid, resid)."""
        got = dict(self.decoded(self.rows(sites, layers, n, changes)))
        for layer in layers:
            for site in sites:
                moves = before_after(site, layer, self.pieces)
                moved = [stacked(got, key, changes) for key in moves]
                yield site, layer, stacked(got, (PIECE[site], layer), range(n)), moved


def stacked(
    got: dict[tuple[Key, int], torch.Tensor], key: Key, rows: Iterable[int]
) -> torch.Tensor:
    """The decoded rows of `key` at the positions `rows`, stacked [n, V]."""
    return torch.stack([got[key, j] for j in rows])


def kl(la: torch.Tensor, lb: torch.Tensor) -> torch.Tensor:
    """KL(a ‖ b) along the last dimension of two log-probabilities (never below 0)."""
    return (la.exp() * (la - lb)).sum(-1).clamp(min=0)


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
    index: int
    """The position read."""


def decode_sites(
    reader: Reader,
    model: nn.Module,
    sites: Sequence[str],
    result: LensResult,
    run: Prompt,
    k: int,
    real_vocab: int,
) -> SiteRows:
    """The sites other than resid at `result`'s layers from 1 decoded through `reader` at the
    positions `result` read (on `model`'s threads), and reduced: the position read to its top-k,
    the others to their top-1 (among the `real_vocab` real tokens); a piece's change there."""
    inner = [s for s in sites if s != "resid"]
    layers, n = [x for x in result.layers if x >= 1], len(result.positions)
    full = result.positions.index(run.index)
    tops: dict[tuple[str, int, int], Top] = {}
    changes: dict[tuple[str, int], Change] = {}
    with torch.inference_mode(), threads_for(model, len(run.ids)):
        for site, layer, x, moved in reader.sites(inner, layers, n, [full]):
            ones = exact_top1(x, real_vocab)
            tops.update({(site, layer, p): ones[j] for j, p in enumerate(result.positions)})
            nexts = next_ids(run.ids, [run.index])
            top = exact_tops(x[full : full + 1], k, real_vocab, run.target_id, nexts)
            tops[(site, layer, run.index)] = top[0]
            if moved:
                changes[(site, layer)] = change(moved[0][0], moved[1][0], k, real_vocab)
    return SiteRows(tops, changes, run.index)


def change(before: torch.Tensor, after: torch.Tensor, k: int, real_vocab: int) -> Change:
    """KL(after ‖ before) over the whole output, and the k real tokens gained the most."""
    lb = torch.log_softmax(before.double(), -1)
    la = torch.log_softmax(after.double(), -1)
    delta = (la - lb)[:real_vocab]
    ids = best(delta[None].float(), k)[0].tolist()
    return Change(float(kl(la, lb)), [(i, float(delta[i]), float(la[i].exp())) for i in ids])
