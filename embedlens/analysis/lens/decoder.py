"""Decoders: what turns a residual vector at some layer into logits.

The engine captures the residual stream and asks a decoder for the logits of rows; it never
reaches into the model's head itself. `ModelDecoder` is the logit lens's decoder, the model's own
tail: to decode a residual h, the model's forward runs once more on a dummy batch with its block
list cut to the last block, whose output a hook replaces with h. Whatever the model does after its
blocks (a final norm of any name or none, OPT's project_out, the head and its bias, softcapping,
logit scales, code that is not a module at all) then runs exactly as the model wrote it, once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from embedlens.analysis.lens.blocks import (
    Blocks,
    first_tensor,
    forward,
    hooked,
    input_device,
    replace_first,
)
from embedlens.analysis.lens.capture import Capture
from embedlens.errors import UnsupportedError


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
