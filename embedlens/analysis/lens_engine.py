"""The logit lens: decode the residual stream after every block through the model's own tail.

Generic by construction. The decoder blocks are found as the model's ModuleList of blocks; hooks
capture the input of the first block (layer 0, the embedding output) and the output of each block
asked for, at the positions asked for only. To decode a residual h, the model's own forward is run
once more on a dummy batch with its block list cut to the last block, whose output a hook replaces
with h: whatever the model does after its blocks (a final norm of any name or none, OPT's
project_out, the head and its bias, softcapping, logit scales, code that is not a module at all)
then runs exactly as the model wrote it, exactly once. A self-check compares the decoding of the
last block's output with the model's real logits, and says which step is suspect if they differ.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from embedlens.errors import NumericError, UnsupportedError

CHUNK_BYTES = 256 * 2**20
"""Logits decoded at once (float32 bytes): rows are decoded in chunks of at most this size."""
SMALL_WORK = 4e9
"""Parameters x tokens below which the lens runs on one CPU thread (see `_threads_for`)."""
_LSE_ROWS = 64
"""Rows whose log-sum-exp `_top1` takes at once (in float64)."""


@dataclass(frozen=True)
class Blocks:
    """Where the decoder blocks live: parent.attr is the ModuleList."""

    parent: nn.Module
    attr: str
    modules: nn.ModuleList


@dataclass(frozen=True)
class Top:
    """The top-k predictions of one row, best first by logit (ties: the lower id first), with
    their probabilities under the full softmax (float32, as the model computes them: they may
    underflow to 0) and their natural-log probabilities (computed in float64: never -inf)."""

    ids: list[int]
    probs: list[float]
    logprobs: list[float] = field(default_factory=list)
    target_prob: float | None = None
    target_rank: int | None = None
    """1 + the real tokens ranked above the target: a higher logit, or the same and a lower id."""
    target_logprob: float | None = None


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


def find_blocks(model: nn.Module) -> Blocks:
    """The ModuleList of decoder blocks: the largest one with as many entries as the config says."""
    root = model
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        try:
            found = get_decoder()
        except Exception:
            found = None
        if isinstance(found, nn.Module):
            root = found
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    expected = getattr(text, "num_hidden_layers", None)
    names = {id(m): n for n, m in model.named_modules()}
    candidates: list[tuple[bool, int, str, nn.ModuleList]] = []
    for name, module in root.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            size = sum(p.numel() for p in module.parameters())
            candidates.append((len(module) == expected, size, name, module))
    if not candidates:
        raise UnsupportedError(
            f"cannot find the decoder blocks of this model ({type(model).__name__})"
        )
    _, _, _, blocks = max(candidates, key=lambda c: (c[0], c[1]))
    full = names[id(blocks)]
    parent_name, _, attr = full.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    return Blocks(parent=parent, attr=attr, modules=blocks)


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def _replace_first(value: Any, tensor: torch.Tensor) -> Any:
    if isinstance(value, torch.Tensor):
        return tensor
    if isinstance(value, tuple):
        return (tensor, *value[1:])
    if isinstance(value, list):
        return [tensor, *value[1:]]
    raise UnsupportedError(
        f"a decoder block returns {type(value).__name__}; the lens needs a tensor"
    )


def input_device(model: nn.Module) -> torch.device:
    """Where input ids go: the embedding's device (accelerate moves them on if it offloads)."""
    try:
        weight = model.get_input_embeddings().weight  # type: ignore[operator]
        device = weight.device
    except Exception:
        device = next(model.parameters()).device
    return torch.device("cpu") if device.type == "meta" else device


def _forward(model: nn.Module, ids: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """The model's logits, [batch, kept positions, V]."""
    kwargs: dict[str, Any] = {"use_cache": False}
    params = inspect.signature(model.forward).parameters
    if keep is not None and "logits_to_keep" in params:
        kwargs["logits_to_keep"] = keep.to(ids.device)
    out = model(input_ids=ids, **kwargs)
    logits: torch.Tensor = out.logits if hasattr(out, "logits") else out[0]
    if keep is not None and "logits_to_keep" not in params:
        logits = logits[:, keep.to(logits.device)]
    return logits


@contextmanager
def _hooks(handles: list[Any]) -> Iterator[None]:
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@dataclass
class _Capture:
    """What the real forward pass leaves behind, at the positions asked for."""

    residual: dict[int, torch.Tensor]
    head_in: torch.Tensor | None = None
    head_out: torch.Tensor | None = None
    steps: list[str] = field(default_factory=list)
    logits: torch.Tensor | None = None


def _capture(
    model: nn.Module,
    blocks: Blocks,
    ids: torch.Tensor,
    layers: Sequence[int],
    positions: torch.Tensor,
) -> tuple[_Capture, torch.Tensor]:
    """Run the model once; keep the residual at each layer and position, and its logits there."""
    cap = _Capture(residual={})
    handles: list[Any] = []

    def keep(layer: int) -> Callable[..., None]:
        def hook(_m: nn.Module, _args: Any, out: Any) -> None:
            t = _first_tensor(out)
            if t is None:
                raise UnsupportedError(f"block {layer} returns no tensor the lens can read")
            cap.residual[layer] = t[0, positions.to(t.device)].detach()

        return hook

    def keep_input(_m: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        t = _first_tensor(args) if args else kwargs.get("hidden_states")
        if not isinstance(t, torch.Tensor):
            raise UnsupportedError("the first block's input is not a tensor the lens can read")
        cap.residual[0] = t[0, positions.to(t.device)].detach()

    if 0 in layers:
        handles.append(blocks.modules[0].register_forward_pre_hook(keep_input, with_kwargs=True))
    for layer in sorted(set(layers) - {0}):
        handles.append(blocks.modules[layer - 1].register_forward_hook(keep(layer)))
    handles += _head_hooks(model, cap)
    with _hooks(handles):
        logits = _forward(model, ids, positions)
    for name in ("head_in", "head_out"):
        t = getattr(cap, name)
        if t is not None and t.shape[0] != len(positions):  # the model ignored logits_to_keep
            setattr(cap, name, t[positions.to(t.device)])
    return cap, logits[0]


def _head_hooks(model: nn.Module, cap: _Capture) -> list[Any]:
    get_head: Any = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Module):
        return []

    def pre(_m: nn.Module, args: Any) -> None:
        t = _first_tensor(args)
        if t is not None:
            cap.head_in = t.detach().reshape(-1, t.shape[-1])

    def post(_m: nn.Module, _args: Any, out: Any) -> None:
        t = _first_tensor(out)
        if t is not None:
            cap.head_out = t.detach().reshape(-1, t.shape[-1])

    return [head.register_forward_pre_hook(pre), head.register_forward_hook(post)]


class Tail:
    """Runs the model's own code after its last block on residual vectors of our choosing."""

    def __init__(self, model: nn.Module, blocks: Blocks, dummy_id: int) -> None:
        self.model = model
        self.blocks = blocks
        self.dummy_id = dummy_id
        self.full = False
        """Run every block (slower) instead of the last one only: set when cutting fails."""

    def __call__(self, rows: torch.Tensor, cap: _Capture | None = None) -> torch.Tensor:
        """Logits [n, V] for residual rows [n, d]; `cap` also receives the head's input/output."""
        if not self.full:
            try:
                return self._run(rows, cap, cut=True)
            except UnsupportedError:
                raise
            except Exception:
                self.full = True
        return self._run(rows, cap, cut=False)

    def _run(self, rows: torch.Tensor, cap: _Capture | None, *, cut: bool) -> torch.Tensor:
        last = self.blocks.modules[-1]

        def replace(_m: nn.Module, _args: Any, out: Any) -> Any:
            t = _first_tensor(out)
            assert t is not None
            h = rows.to(device=t.device, dtype=t.dtype).reshape(rows.shape[0], 1, -1)
            return _replace_first(out, h)

        handles = [last.register_forward_hook(replace)]
        if cap is not None:
            handles += _head_hooks(self.model, cap)
        ids = torch.full(
            (rows.shape[0], 1), self.dummy_id, dtype=torch.long, device=input_device(self.model)
        )
        parent, attr = self.blocks.parent, self.blocks.attr
        with _hooks(handles):
            if not cut:
                return _forward(self.model, ids, None)[:, 0]
            setattr(parent, attr, nn.ModuleList([last]))
            try:
                return _forward(self.model, ids, None)[:, 0]
            finally:
                setattr(parent, attr, self.blocks.modules)


def tail_steps(model: nn.Module, blocks: Blocks, tail: Tail, row: torch.Tensor) -> _Capture:
    """Run the tail on one row, noting the modules that run after the last block (outermost only).

    Returns the head's input and output for that row, with the module names in `steps`.
    """
    names = {id(m): n for n, m in model.named_modules()}
    last = blocks.modules[-1]
    after = [False]
    started: list[int] = []
    finished: list[str] = []

    def pre(module: nn.Module, _args: Any) -> None:
        if after[0] and id(module) in names:
            started.append(id(module))

    def post(module: nn.Module, _args: Any, _out: Any) -> None:
        if module is last:
            after[0] = True
        elif after[0] and id(module) in started:
            finished.append(names[id(module)])

    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )

    probe = _Capture(residual={})
    with _hooks([register_module_forward_pre_hook(pre), register_module_forward_hook(post)]):
        probe.logits = tail(row[None], probe).float()
    outer: list[str] = []
    for name in finished:  # children finish before their parents
        if not any(name.startswith(o + ".") for o in outer):
            outer = [o for o in outer if not o.startswith(name + ".")]
            outer.append(name)
    probe.steps = outer
    return probe


def post_head_step(head_out: torch.Tensor, logits: torch.Tensor, tol: float) -> str | None:
    """Describe what the model does to the head's output, found by comparing the two.

    Both come from the same tail run, so in float32 the relation holds to rounding: a candidate
    (a scale, or a softcap c·tanh(x/c)) must fit to 1e-5 relative, or to `tol` in 16-bit dtypes.
    """
    x, y = head_out.double(), logits.double()
    fit = max(min(tol, 1e-5 * max(1.0, float(y.abs().max()))), 1e-7)
    if float((y - x).abs().max()) <= fit:
        return None
    denom = float((x * x).sum())
    if denom > 0:
        c = float((x * y).sum()) / denom
        if float((y - c * x).abs().max()) <= fit:
            return f"logits scaled by {c:.6g}"
    i = int(x.abs().argmax())
    xi, yi = abs(float(x.flatten()[i])), abs(float(y.flatten()[i]))
    if 0 < yi < xi:
        lo, hi = yi, yi * 1e6
        for _ in range(200):
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if mid * math.tanh(xi / mid) < yi else (lo, mid)
        c = math.sqrt(lo * hi)
        if float((y - c * torch.tanh(x / c)).abs().max()) <= fit:
            return f"softcapping c·tanh(logits/c), c = {c:.4g}"
    return "a step after the head (neither a plain scale nor a softcap)"


def tolerance(dtype: torch.dtype, logits: torch.Tensor) -> float:
    """1e-3 in float32; in a 16-bit dtype, what its rounding allows at these logits' size."""
    if dtype in (torch.float32, torch.float64):
        return 1e-3
    scale = max(1.0, float(logits.abs().max()))
    return max(1e-3, 8 * torch.finfo(dtype).eps * scale)


def _top(logits: torch.Tensor, k: int, real_vocab: int, target: int | None) -> list[Top]:
    """Predictions only among the tokenizer's ids, ranked by logit; probabilities from the softmax
    over the model's whole output (padding rows too), which can underflow where logits cannot."""
    x = logits.float()
    probs = torch.softmax(x, dim=-1)
    real = x[:, :real_vocab]
    kk = min(k, real_vocab)
    kth = real.topk(kk, dim=-1).values[:, -1]
    out: list[Top] = []
    with one_thread():  # a reduction to one value is split between threads: same bytes on any
        lses = [torch.logsumexp(x[r].double(), dim=-1) for r in range(x.shape[0])]
    for r, lse in enumerate(lses):
        ids = _best_ids(real[r], kth[r], kk)
        at: dict[str, Any] = {}
        if target is not None:
            t = x[r, target]
            above = (real[r] > t).sum() + (real[r, : min(target, real_vocab)] == t).sum()
            at = {
                "target_prob": float(probs[r, target]),
                "target_rank": int(above) + 1,
                "target_logprob": float(t.double() - lse),
            }
        logprobs = (x[r, ids].double() - lse).tolist()
        out.append(Top(ids.tolist(), probs[r, ids].tolist(), logprobs, **at))
    return out


def _top1(logits: torch.Tensor, real_vocab: int) -> list[Top]:
    """`_top` with k = 1 and no target, for many rows at once (the grid's cells): the same values
    (the lowest id of the highest logit, its softmax probability, its log-probability in float64),
    with each row reduced on its own but no Python work per row beyond building its `Top`."""
    x = logits.float()
    best = x[:, :real_vocab].argmax(dim=-1, keepdim=True)  # the first of equal logits
    probs = torch.softmax(x, dim=-1).gather(1, best)[:, 0].tolist()
    blocks = range(0, x.shape[0], _LSE_ROWS)
    lse = torch.cat([torch.logsumexp(x[i : i + _LSE_ROWS].double(), dim=-1) for i in blocks])
    logprobs = (x.gather(1, best)[:, 0].double() - lse).tolist()
    ids = best[:, 0].tolist()
    return [Top([i], [p], [lp]) for i, p, lp in zip(ids, probs, logprobs, strict=True)]


def _best_ids(row: torch.Tensor, kth: torch.Tensor, k: int) -> torch.Tensor:
    """The k ids of highest logit in one row, best first, equal logits in id order."""
    candidates = (row >= kth).nonzero().flatten()  # in id order: a stable sort keeps it
    order = torch.sort(row[candidates], descending=True, stable=True).indices[:k]
    return candidates[order]


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
) -> LensResult:
    """Decode `layers` (0 = embedding output, L = the model's output) at `positions`.

    Positions are absolute indices into `input_ids`. `real_vocab` is the tokenizer's length: rows
    past it are padding and never predicted, though the softmax runs over every row. `full_at`:
    the positions whose rows hold the top-k and the target (all by default); the others hold
    their top-1 only (a grid's cells), whatever k is.
    """
    blocks = find_blocks(model)
    n_layers = len(blocks.modules)
    bad = [x for x in layers if not 0 <= x <= n_layers]
    if bad:
        raise UnsupportedError(f"layer {bad[0]} does not exist: the model has {n_layers} blocks")
    device = input_device(model)
    ids = torch.tensor([list(input_ids)], dtype=torch.long, device=device)
    pos = torch.tensor(list(positions), dtype=torch.long)
    with torch.inference_mode(), _threads_for(model, len(input_ids)):
        cap, logits = _capture(model, blocks, ids, sorted(set(layers) | {n_layers}), pos)
        real = logits.float()
        if not bool(torch.isfinite(real).all()):
            raise _model_not_finite(model, blocks, ids, pos, real)
        vocab = int(real.shape[-1])
        if target is not None and not 0 <= target < vocab:
            raise UnsupportedError(f"token {target} has no row in the model's output ({vocab})")
        full = None if full_at is None else frozenset(int(p) for p in full_at)
        job = _Job(layers, n_layers, pos, k, min(real_vocab, vocab), target, real, full)
        tail = Tail(model, blocks, dummy_id=int(input_ids[0]))
        rows, diff, agrees = job.decode(tail, cap.residual, device)
        tol = tolerance(next(model.parameters()).dtype, real)
        if diff > tol and not tail.full:  # cutting the block list may have changed the tail
            tail.full = True
            retry = job.decode(tail, cap.residual, device)
            if retry[1] < diff:
                rows, diff, agrees = retry
            else:
                tail.full = False
        steps, probe = _steps(model, blocks, tail, cap.residual[n_layers][0].to(device), tol)
        suspect = _suspect(cap, probe, tol) if diff > tol else None
    return LensResult(
        num_layers=n_layers,
        vocab_size=vocab,
        positions=[int(p) for p in pos],
        layers=sorted(set(layers)),
        rows=rows,
        check=Check(diff, tol, agrees, suspect),
        steps=steps,
        full_tail=tail.full,
    )


def _steps(
    model: nn.Module, blocks: Blocks, tail: Tail, row: torch.Tensor, tol: float
) -> tuple[list[str], _Capture]:
    """What runs after the last block, found on one row: its modules, then a post-head step."""
    probe = tail_steps(model, blocks, tail, row)
    steps = list(probe.steps)
    if probe.head_out is not None and probe.logits is not None:
        post = post_head_step(probe.head_out.float(), probe.logits, tol)
        if post is not None:
            steps.append(post)
    return steps, probe


@dataclass(frozen=True)
class _Job:
    """What to decode, and how to reduce each row as soon as it is decoded."""

    layers: Sequence[int]
    n_layers: int
    pos: torch.Tensor
    k: int
    real_vocab: int
    target: int | None
    real: torch.Tensor
    """The model's own logits at `pos`, float32 [P, V]."""
    full_at: frozenset[int] | None = None
    """Positions reduced to the top-k and the target (None: all); the others to their top-1."""

    def decode(
        self, tail: Tail, residual: dict[int, torch.Tensor], device: torch.device
    ) -> tuple[dict[tuple[int, int], Top], float, bool]:
        """Every (layer, position) reduced to its top-k, plus the self-check on the last block.

        Rows go through the tail in chunks of bounded size and only their top-k is kept, so a
        layer x position grid never holds more than one chunk of logits.
        """
        wanted = sorted(set(self.layers) | {self.n_layers})
        order = [(layer, j) for layer in wanted for j in range(len(self.pos))]
        chunk = max(1, CHUNK_BYTES // (4 * int(self.real.shape[-1])))
        rows: dict[tuple[int, int], Top] = {}
        diff, agrees = 0.0, True
        for start in range(0, len(order), chunk):
            part = order[start : start + chunk]
            h = torch.stack([residual[layer][j].to(device) for layer, j in part])
            out = tail(h).float()
            _check_decoded(out, part, self.pos)
            last = [i for i, (layer, _) in enumerate(part) if layer == self.n_layers]
            if last:
                mine = out[last]
                theirs = self.real[[part[i][1] for i in last]].to(mine.device)
                diff = max(diff, float((mine - theirs).abs().max()))
                agrees = agrees and bool((mine.argmax(-1) == theirs.argmax(-1)).all())
            keep = [i for i, (layer, _) in enumerate(part) if layer != self.n_layers]
            keep = [i for i in keep if part[i][0] in self.layers]
            if keep:
                where = [(part[i][0], int(self.pos[part[i][1]])) for i in keep]
                rows.update(self._reduce(where, out[keep]))
        if self.n_layers in self.layers:  # the last layer is the model's own output
            where = [(self.n_layers, int(p)) for p in self.pos]
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
        out = dict(zip(where, _top1(logits, self.real_vocab), strict=True))
        if full:
            out.update(zip([where[i] for i in full], self._top(logits[full]), strict=True))
        return out

    def _top(self, logits: torch.Tensor) -> list[Top]:
        return _top(logits, self.k, self.real_vocab, self.target)


def _kind(t: torch.Tensor) -> str:
    """'NaN' or 'infinite' (NaN first: it is the worse of the two)."""
    return "NaN" if bool(torch.isnan(t).any()) else "infinite"


def _check_decoded(out: torch.Tensor, part: list[tuple[int, int]], pos: torch.Tensor) -> None:
    """Refuse a decoded row that is not finite (the model's own logits were finite)."""
    if bool(torch.isfinite(out.sum(-1)).all()):  # a NaN or an infinity makes its row's sum one
        return
    bad = ~torch.isfinite(out).all(-1)  # a sum of finite logits may overflow: look at each
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        layer, j = part[i]
        raise NumericError(
            f"decoding layer {layer} at position {int(pos[j])} through the model's final steps "
            f"gives {_kind(out[i])} logits, though the model's own logits are finite: the lens "
            "cannot be read there",
            hint="in a 16-bit dtype the lens can overflow: try --dtype float32",
        )


def _model_not_finite(
    model: nn.Module, blocks: Blocks, ids: torch.Tensor, pos: torch.Tensor, real: torch.Tensor
) -> NumericError:
    """Say where the model's own NaN or infinity starts: the first layer whose residual stream is
    not finite at the positions read, or the steps after the last block."""
    n_layers = len(blocks.modules)
    every = torch.arange(ids.shape[1])  # where it starts may be an earlier position
    cap, _ = _capture(model, blocks, ids, list(range(n_layers + 1)), every)
    row = int((~torch.isfinite(real).all(-1)).nonzero()[0, 0])
    what = f"the model itself gives {_kind(real)} logits at position {int(pos[row])}"
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


@contextmanager
def _threads_for(
    model: nn.Module, n_tokens: int, others_busy: Callable[[], float] | None = None
) -> Iterator[None]:
    """One CPU thread for a small forward pass, the default otherwise; with `others_busy`
    (cores other processes keep busy, asked only for large work), one thread for large work too
    while that reaches torch's thread count.

    A short prompt through a small model is hundreds of thin matmuls; with several threads each
    one ends in a barrier, and on a machine whose other cores are busy every barrier waits for a
    time slice (measured on 2 busy cores: SmolLM2 on 5 tokens, 0.15 s on one thread, 1.5 to 3.6 s
    on two). Large work keeps torch's own setting unless the cores are busy.
    """
    on_cpu = input_device(model).type == "cpu"
    work = sum(p.numel() for p in model.parameters()) * n_tokens
    before = torch.get_num_threads()
    large = work >= SMALL_WORK
    if not on_cpu or before == 1 or (large and (others_busy is None or others_busy() < before)):
        yield
        return
    with one_thread():
        yield


@contextmanager
def one_thread() -> Iterator[None]:
    """torch's CPU work on one thread inside the block. A reduction whose result is a single
    value (one row's sum) is split between threads and its parts added in another order, so
    its last bits would depend on the thread count; on one thread they do not."""
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _suspect(real: _Capture, probe: _Capture, tol: float) -> str:
    """Name the first step whose result differs between the real pass and the lens's tail."""
    modules = ", ".join(probe.steps) or "none found"
    if real.head_in is None or probe.head_in is None:
        return f"the steps after the last block ({modules})"
    if float((real.head_in[:1] - probe.head_in[:1]).abs().max()) > tol:
        return f"the steps between the last block and the head ({modules})"
    assert real.head_out is not None and probe.head_out is not None
    if float((real.head_out[:1] - probe.head_out[:1]).abs().max()) > tol:
        return "the head itself"
    return "the steps after the head (code that turns the head's output into logits)"
