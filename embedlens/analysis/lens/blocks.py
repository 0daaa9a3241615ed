"""The model as the lens runs it: its decoder blocks, one forward pass that keeps the residual
stream, and the decoder that turns a residual vector into logits.

Blocks: the model's ModuleList with as many entries as its config says (the largest such),
whatever the architecture names it; generic by construction.

Capture: layer 0 is the first block's input (the embedding output), layer i block i's output. A
batch of prompts is padded on the right with an attention mask: in a causal model a real token
never attends to the padding after it, and its position ids are those of a single run. A single
prompt runs without a mask, as a plain call of the model does.

Decoders: the engine captures the residual stream and asks a decoder for the logits of rows; it
never reaches into the model's head itself. `ModelDecoder` is the logit lens's decoder, the
model's own tail: to decode a residual h, the model's forward runs once more on a dummy batch
with its block list cut to the last block, whose output a hook replaces with h. Whatever the
model does after its blocks (a final norm of any name or none, OPT's project_out, the head and
its bias, softcapping, logit scales, code that is not a module at all) then runs exactly as the
model wrote it, once.

How many CPU threads torch uses for a lens run (`threads_for`, from the work's size, never from the machine's load), and one thread where the bytes depend on it (`one_thread`), live here too.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from embedlens.errors import UnsupportedError


@dataclass(frozen=True)
class Blocks:
    """Where the decoder blocks live: parent.attr is the ModuleList."""

    parent: nn.Module
    attr: str
    modules: nn.ModuleList


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


def first_tensor(value: Any) -> torch.Tensor | None:
    """A module's output tensor: the value itself, or the first item of a tuple or list."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def replace_first(value: Any, tensor: torch.Tensor) -> Any:
    """A module's output with its tensor (as `first_tensor` finds it) replaced."""
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


def forward(
    model: nn.Module,
    ids: torch.Tensor,
    keep: torch.Tensor | None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The model's logits, [batch, kept positions, V] (`keep`: the positions kept, all when None;
    `mask`: the attention mask of a padded batch)."""
    kwargs: dict[str, Any] = {"use_cache": False}
    if mask is not None:
        kwargs["attention_mask"] = mask
    params = inspect.signature(model.forward).parameters
    if keep is not None and "logits_to_keep" in params:
        kwargs["logits_to_keep"] = keep.to(ids.device)
    out = model(input_ids=ids, **kwargs)
    logits: torch.Tensor = out.logits if hasattr(out, "logits") else out[0]
    if keep is not None and "logits_to_keep" not in params:
        logits = logits[:, keep.to(logits.device)]
    return logits


@contextmanager
def hooked(handles: list[Any]) -> Iterator[None]:
    """The hooks `handles` stay registered inside the block, and are removed after it."""
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@dataclass
class Capture:
    """What a forward pass leaves behind at the rows read: row r is (prompt bi[r], position pi[r])."""

    residual: dict[int, torch.Tensor]
    """layer -> [rows, d]."""
    logits: torch.Tensor | None = None
    """The model's own logits, float32 [rows, V]."""
    head_in: torch.Tensor | None = None
    """With a head watched: the head's input and output rows."""
    head_out: torch.Tensor | None = None
    steps: list[str] = field(default_factory=list)
    device: torch.device | None = None
    """Where the model's input went (`input_device`)."""


Watch = Callable[[Capture], list[Any]]
"""Registers hooks that fill a capture's head_in and head_out (the decoder's `watch`)."""


def padded(
    prompts: Sequence[Sequence[int]], masked: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The prompts' ids as one [batch, longest] tensor padded on the right, and the attention
    mask (with `masked`; else None: one prompt, nothing padded)."""
    if not masked:
        assert len(prompts) == 1
        return torch.tensor([list(prompts[0])], dtype=torch.long), None
    width = max(len(ids) for ids in prompts)
    ids = torch.full((len(prompts), width), prompts[0][0], dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, row in enumerate(prompts):
        ids[b, : len(row)] = torch.tensor(list(row))
        mask[b, : len(row)] = 1
    return ids, mask


def capture(
    model: nn.Module,
    blocks: Blocks,
    prompts: Sequence[Sequence[int]],
    reads: Sequence[Sequence[int]],
    layers: Sequence[int],
    watch: Watch | None = None,
    *,
    masked: bool = True,
    logits: bool = True,
) -> Capture:
    """Run the model once on `prompts`, keeping the residual at each of `layers` and the logits
    at the positions `reads[b]` of each prompt b, in that order. `masked`: pass an attention mask
    (a batch); a single prompt may run without one (`masked=False`), as a plain call does.
    `logits=False`: the residual stream only (the head runs on one position; `logits` is None)."""
    device = input_device(model)
    ids, mask = padded(prompts, masked)
    bi = torch.tensor([b for b, read in enumerate(reads) for _ in read], dtype=torch.long)
    pi = torch.tensor([p for read in reads for p in read], dtype=torch.long)
    cap = Capture(residual={}, device=device)

    def keep(layer: int) -> Callable[..., None]:
        def hook(_m: nn.Module, _args: Any, out: Any) -> None:
            t = first_tensor(out)
            if t is None:
                raise UnsupportedError(f"block {layer} returns no tensor the lens can read")
            cap.residual[layer] = t[bi.to(t.device), pi.to(t.device)].detach()

        return hook

    def keep_input(_m: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        t = first_tensor(args) if args else kwargs.get("hidden_states")
        if not isinstance(t, torch.Tensor):
            raise UnsupportedError("the first block's input is not a tensor the lens can read")
        cap.residual[0] = t[bi.to(t.device), pi.to(t.device)].detach()

    handles: list[Any] = []
    if 0 in layers:
        handles.append(blocks.modules[0].register_forward_pre_hook(keep_input, with_kwargs=True))
    for layer in sorted(set(layers) - {0}):
        handles.append(blocks.modules[layer - 1].register_forward_hook(keep(layer)))
    if watch is not None:
        handles += watch(cap)
    kept = torch.unique(pi) if logits else torch.unique(pi)[-1:]
    with hooked(handles):
        out = forward(model, ids.to(device), kept, None if mask is None else mask.to(device))
    for name in ("head_in", "head_out"):
        t = getattr(cap, name)
        if t is not None and t.shape[0] != len(kept):  # the model ignored logits_to_keep
            setattr(cap, name, t[kept.to(t.device)])
    if logits:
        at = torch.searchsorted(kept, pi)
        whole = len(prompts) == 1 and bool(torch.equal(at, torch.arange(out.shape[1])))
        # one prompt read at every position it kept, in order: its rows as they are (no copy)
        cap.logits = out[0] if whole else out[bi.to(out.device), at.to(out.device)]
        cap.logits = cap.logits.float()
    return cap


class Decoder(Protocol):
    """Logits for residual rows; the model's own decoder, or one built on it."""

    full: bool
    """True when the steps after the last block ran with every block in place (cutting the
    block list failed, or changed what the model computes)."""

    def logits(self, rows: torch.Tensor, layers: Sequence[int]) -> torch.Tensor:
        """Logits [n, V] for residual rows [n, d]; row i was read at layer layers[i]."""
        ...

    def watch(self, cap: Capture) -> list[Any]:
        """Hooks (to remove after the pass) that fill cap.head_in and cap.head_out."""
        ...

    def steps(self, row: torch.Tensor, tol: float) -> list[str]:
        """What runs after the last block, found on one row (module names, then a post-head
        step); found once per decoder."""
        ...

    def suspect(self, real: Capture, tol: float) -> str:
        """The first step whose result differs between the real pass and the decoder's run
        (after `steps`)."""
        ...


class ModelDecoder:
    """The model's own tail after its last block, run on residual vectors of our choosing."""

    def __init__(self, model: nn.Module, blocks: Blocks, dummy_id: int) -> None:
        self.model = model
        self.blocks = blocks
        self.dummy_id = dummy_id
        self.full = False
        self._found: tuple[list[str], Capture] | None = None

    def logits(self, rows: torch.Tensor, layers: Sequence[int] = ()) -> torch.Tensor:
        """Logits [n, V] for residual rows [n, d] (the same tail at every layer)."""
        return self._logits(rows, None)

    def _logits(self, rows: torch.Tensor, cap: Capture | None) -> torch.Tensor:
        """The tail's logits; `cap` also receives the head's input and output."""
        if not self.full:
            try:
                return self._run(rows, cap, cut=True)
            except UnsupportedError:
                raise
            except Exception:
                self.full = True
        return self._run(rows, cap, cut=False)

    def _run(self, rows: torch.Tensor, cap: Capture | None, *, cut: bool) -> torch.Tensor:
        last = self.blocks.modules[-1]

        def replace(_m: nn.Module, _args: Any, out: Any) -> Any:
            t = first_tensor(out)
            assert t is not None
            h = rows.to(device=t.device, dtype=t.dtype).reshape(rows.shape[0], 1, -1)
            return replace_first(out, h)

        handles = [last.register_forward_hook(replace)]
        if cap is not None:
            handles += self.watch(cap)
        ids = torch.full(
            (rows.shape[0], 1), self.dummy_id, dtype=torch.long, device=input_device(self.model)
        )
        parent, attr = self.blocks.parent, self.blocks.attr
        with hooked(handles):
            if not cut:
                return forward(self.model, ids, None)[:, 0]
            setattr(parent, attr, nn.ModuleList([last]))
            try:
                return forward(self.model, ids, None)[:, 0]
            finally:
                setattr(parent, attr, self.blocks.modules)

    def watch(self, cap: Capture) -> list[Any]:
        """Hooks on the model's head that keep its input and output rows in `cap`."""
        get_head: Any = getattr(self.model, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        if not isinstance(head, nn.Module):
            return []

        def pre(_m: nn.Module, args: Any) -> None:
            t = first_tensor(args)
            if t is not None:
                cap.head_in = t.detach().reshape(-1, t.shape[-1])

        def post(_m: nn.Module, _args: Any, out: Any) -> None:
            t = first_tensor(out)
            if t is not None:
                cap.head_out = t.detach().reshape(-1, t.shape[-1])

        return [head.register_forward_pre_hook(pre), head.register_forward_hook(post)]

    def steps(self, row: torch.Tensor, tol: float) -> list[str]:
        """The modules that run after the last block, then a post-head step if the model has
        one; found on one row, the first time only."""
        if self._found is None:
            probe = self.probe(row)
            steps = list(probe.steps)
            if probe.head_out is not None and probe.logits is not None:
                post = post_head_step(probe.head_out.float(), probe.logits, tol)
                if post is not None:
                    steps.append(post)
            self._found = steps, probe
        return self._found[0]

    def probe(self, row: torch.Tensor) -> Capture:
        """Run the tail on one row, noting the modules that run after the last block (outermost
        only), with the head's input and output for that row."""
        model = self.model
        names = {id(m): n for n, m in model.named_modules()}
        last = self.blocks.modules[-1]
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

        probe = Capture(residual={})
        with hooked([register_module_forward_pre_hook(pre), register_module_forward_hook(post)]):
            probe.logits = self._logits(row[None], probe).float()
        outer: list[str] = []
        for name in finished:  # children finish before their parents
            if not any(name.startswith(o + ".") for o in outer):
                outer = [o for o in outer if not o.startswith(name + ".")]
                outer.append(name)
        probe.steps = outer
        return probe

    def suspect(self, real: Capture, tol: float) -> str:
        """Name the first step whose result differs between the real pass and the tail."""
        assert self._found is not None, "steps() first"
        probe = self._found[1]
        modules = ", ".join(probe.steps) or "none found"
        if real.head_in is None or probe.head_in is None:
            return f"the steps after the last block ({modules})"
        if float((real.head_in[:1] - probe.head_in[:1]).abs().max()) > tol:
            return f"the steps between the last block and the head ({modules})"
        assert real.head_out is not None and probe.head_out is not None
        if float((real.head_out[:1] - probe.head_out[:1]).abs().max()) > tol:
            return "the head itself"
        return "the steps after the head (code that turns the head's output into logits)"


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


SMALL_WORK = 4e9
"""Parameters x tokens below which the lens runs on one CPU thread (see `threads_for`)."""


@contextmanager
def threads_for(model: nn.Module, n_tokens: int) -> Iterator[None]:
    """One CPU thread for a small forward pass, torch's own setting otherwise: chosen from the
    work's size alone, never from the machine's load, since the thread count can move the last
    bits of a forward pass (seen on SmolLM2: 2 of 64 prompts' rows in a batch on two threads) and
    a figure must not depend on what else the machine runs.

    A short prompt through a small model is hundreds of thin matmuls; with several threads each
    one ends in a barrier that waits for a time slice when the other cores are busy (measured on
    2 busy cores: SmolLM2 on 5 tokens, 0.15 s on one thread, 1.5 to 3.6 s on two).
    """
    on_cpu = input_device(model).type == "cpu"
    work = sum(p.numel() for p in model.parameters()) * n_tokens
    if not on_cpu or torch.get_num_threads() == 1 or work >= SMALL_WORK:
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
