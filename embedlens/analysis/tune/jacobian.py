"""Fit the Jacobian lens (Gurnee et al., 2026) to any model the lens runs on, on the CPU.

For each source layer l (block l's output, the artifact's numbering) the lens is one d x d
matrix, averaged over prompts:

    J_l = (1/|V|) sum_{t in V} sum_{t' in V, t' >= t} d h_final,t' / d h_l,t

h_final is the last block's output (before the final norm); V the valid positions, skip_first ..
seq_len - 2. One forward pass per prompt keeps the graph from the earliest source layer (the
model's parameters frozen, that output made the graph's root); backward passes through it plant
cotangents at every valid target position at once (causality gives the sum over t' >= t) and
average the gradients over the valid source positions.

`exact` (the reference's estimator, as TransformerLens's `JacobianLens.fit` computes it): the
prompt replicated `dim_batch` times, ceil(d / dim_batch) backward passes of one-hot cotangents,
one output dimension per copy: each pass gives `dim_batch` rows of J.

`sketch`: `dim_batch` random probes v per backward pass (Rademacher or Gaussian, seeded by the
seed, the prompt and the round), each planted at every valid position; the position-averaged
gradient is g = J^T v. Since E[v v^T] = I, E[v (g - v)^T] = E[v v^T] (J - I) = J - I, so

    J ~ I + (1/r) sum_k v_k (g_k - v_k)^T

is unbiased, the identity a control variate: an entry's variance is that of the plain estimate
(1/r) sum_k v_k g_k^T with J - I in place of J (for Rademacher probes, the sum of the squares of
its column's other entries), and the residual stream keeps J close to I. Probes alternate
between two halves; after each round (every prompt gets `dim_batch` more probes) the halves'
estimates are compared per layer (cosine of the flattened matrices), and the fit stops when
every layer's agreement reaches `agree`, or at `probes` per prompt. With halves agreeing at c,
each half's noise is (1/c - 1) of the signal's energy, the whole's half that: its expected
cosine to the exact fit on the same prompts is (1 + (1/c - 1)/2)^(-1/2) (0.9975 at c = 0.99).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from embedlens.analysis.lens.blocks import (
    Blocks,
    find_blocks,
    first_tensor,
    forward,
    input_device,
    replace_first,
    threads_for,
)
from embedlens.errors import UnsupportedError, UsageError
from embedlens.progress import Progress

ESTIMATORS = ("exact", "sketch")
CONTROLS = ("scaled", "identity", "none")
"""The sketch's control variates: a I with a = tr(J)/d (cross-fitted between the halves), I,
none."""
PROBE_KINDS = ("orthogonal", "rademacher", "gaussian")
DIM_BATCH = 8
"""Output dimensions (or probes) per backward pass, as the reference's default."""
AGREE = 0.99
"""The sketch stops when its two halves agree this well (cosine) at every layer."""
SKIP_FIRST = 16
"""Leading positions left out of V, as the reference's default."""


@dataclass(frozen=True)
class JacobianFit:
    """A fitted Jacobian lens and how it was fitted."""

    matrices: dict[int, torch.Tensor]
    """Artifact layer (block l's output) -> J_l, [d, d] float32."""
    n_prompts: int
    """Prompts that contributed (those with a valid position)."""
    skipped: int
    """Prompts too short for a valid position (fewer than skip_first + 2 tokens)."""
    estimator: str
    skip_first: int
    dim_batch: int
    backward_passes: int
    forward_passes: int
    probes: int | None = None
    """The sketch's probes per prompt (None: exact)."""
    probe_kind: str | None = None
    control: str | None = None
    """The sketch's control variate: 'scaled' (a multiple of I, cross-fitted), 'identity' or
    'none'."""
    agreement: dict[int, float] | None = None
    """The sketch: per layer, the cosine between the two halves' estimates."""
    agreed: bool | None = None
    """The sketch: it stopped because every layer's halves agreed (else at `probes`)."""


def fit_jacobian(
    model: nn.Module,
    sequences: Sequence[Sequence[int]],
    *,
    skip_first: int = SKIP_FIRST,
    estimator: str = "exact",
    dim_batch: int = DIM_BATCH,
    probes: int | None = None,
    agree: float = AGREE,
    seed: int = 0,
    layers: Sequence[int] | None = None,
    probe_kind: str = "orthogonal",
    control: str = "scaled",
    progress: Progress | None = None,
) -> JacobianFit:
    """The Jacobian lens of `model` over the token ids `sequences`, at artifact `layers`
    (0..L-2 by default). `probes`: the sketch's most probes per prompt (by default ceil(d/8)
    rounded up to dim_batch: at most 1/8 of the exact fit's backward passes). `control`: the
    sketch's control variate (`CONTROLS`). The model's flags and the grad mode are restored after;
    `progress('jacobian', done, total, unit)` after each prompt (exact) or round (sketch)."""
    blocks = find_blocks(model)
    n_blocks = len(blocks.modules)
    fit_layers = _layers(layers, n_blocks)
    _check(estimator, dim_batch, probes, agree, (probe_kind, control), skip_first)
    usable = [list(s) for s in sequences if len(s) >= skip_first + 2]
    if not usable:
        longest = max((len(s) for s in sequences), default=0)
        raise UsageError(
            f"no sequence has a valid position: they need at least skip_first + 2 = "
            f"{skip_first + 2} tokens (the longest has {longest})",
            hint="give a smaller skip_first, or longer sequences",
        )
    run = _Run(model, blocks, fit_layers, dim_batch, progress)
    skipped = len(sequences) - len(usable)
    with _fitting(model):
        if estimator == "exact":
            return run.exact(usable, skip_first, skipped)
        d = _width(model)
        most = probes if probes is not None else _default_probes(d, dim_batch)
        return run.sketch(usable, skip_first, skipped, (most, agree, seed, probe_kind, control))


def _default_probes(d: int, dim_batch: int) -> int:
    """ceil(d / 8) probes rounded up to whole passes of dim_batch."""
    return -(-math.ceil(d / 8) // dim_batch) * dim_batch


def _layers(layers: Sequence[int] | None, n_blocks: int) -> list[int]:
    """The artifact layers asked for, checked: 0..L-2 (the last block has no matrix)."""
    if n_blocks < 2:
        raise UnsupportedError("the Jacobian lens needs a model of at least 2 blocks")
    if layers is None:
        return list(range(n_blocks - 1))
    chosen = sorted({int(x) for x in layers})
    bad = [x for x in chosen if not 0 <= x <= n_blocks - 2]
    if bad or not chosen:
        raise UsageError(
            f"the Jacobian lens's layers are blocks 0..{n_blocks - 2}'s outputs, not {bad or '[]'}"
        )
    return chosen


def _check(
    estimator: str,
    dim_batch: int,
    probes: int | None,
    agree: float,
    kinds: tuple[str, str],
    skip: int,
) -> None:
    """One error line for an option that makes no sense."""
    kind, control = kinds
    if estimator not in ESTIMATORS:
        raise UsageError(f"unknown estimator {estimator!r}", hint="use exact or sketch")
    if isinstance(dim_batch, bool) or not isinstance(dim_batch, int) or dim_batch < 1:
        raise UsageError(f"dim_batch must be a positive integer, not {dim_batch!r}")
    if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
        raise UsageError(f"skip_first must be a non-negative integer, not {skip!r}")
    if estimator == "exact":
        if probes is not None:
            raise UsageError("probes apply to the sketch: the exact estimator has none")
        return
    if probes is not None and (isinstance(probes, bool) or not isinstance(probes, int)
                               or probes < 2 or probes % 2):  # fmt: skip
        raise UsageError(f"probes must be an even integer of at least 2, not {probes!r}")
    if dim_batch % 2:
        raise UsageError(f"the sketch's dim_batch must be even (two halves), not {dim_batch}")
    if not isinstance(agree, (int, float)) or isinstance(agree, bool) or not 0 < agree <= 1:
        raise UsageError(f"agree must be a cosine in (0, 1], not {agree!r}")
    if kind not in PROBE_KINDS:
        raise UsageError(
            f"unknown probe kind {kind!r}", hint="use orthogonal, rademacher or gaussian"
        )
    if control not in CONTROLS:
        raise UsageError(f"unknown control {control!r}", hint="use scaled, identity or none")


def _width(model: nn.Module) -> int:
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    width = getattr(text, "hidden_size", None) or getattr(text, "n_embd", None)
    if not isinstance(width, int):
        raise UnsupportedError("the model's config gives no hidden size")
    return width


@contextmanager
def _fitting(model: nn.Module) -> Iterator[None]:
    """Parameters frozen, every module in eval mode, gradients on; all restored after."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    modes = [(m, m.training) for m in model.modules()]
    grad = torch.is_grad_enabled()
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        model.eval()
        torch.set_grad_enabled(True)
        yield
    finally:
        torch.set_grad_enabled(grad)
        for m, training in modes:
            m.training = training
        for p, flag in flags:
            p.requires_grad_(flag)


class _Stop(Exception):
    """Raised by the last block's hook: nothing after it is needed."""


class _Run:
    """The fit's passes on one model."""

    def __init__(
        self,
        model: nn.Module,
        blocks: Blocks,
        layers: list[int],
        dim_batch: int,
        progress: Progress | None,
    ) -> None:
        self.model, self.blocks, self.layers = model, blocks, layers
        self.dim_batch, self.progress = dim_batch, progress
        self.vv: list[torch.Tensor] = []
        """The sketch: per half, the sum of v v^T over its probes (the same at every layer)."""
        self.target = len(blocks.modules) - 1
        self.backward = self.forward = 0
        self.designs: dict[tuple[int, int, int], torch.Tensor] = {}
        """The sketch's orthogonal probes: the matrix in use (`_design`)."""

    def graph(self, ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One forward pass of `ids` replicated dim_batch times: the last block's output and
        the source layers' outputs, in a graph rooted at the earliest source."""
        kept: dict[int, torch.Tensor] = {}
        root = self.layers[0]

        def hook(layer: int) -> Any:
            def keep(_m: nn.Module, _args: Any, out: Any) -> Any:
                t = first_tensor(out)
                if t is None:
                    raise UnsupportedError(f"block {layer} returns no tensor the lens can read")
                if layer == root:
                    leaf = t.detach().requires_grad_(True)
                    kept[layer] = leaf
                    return replace_first(out, leaf)
                kept[layer] = t
                if layer == self.target:
                    raise _Stop
                return None

            return keep

        handles = [self.blocks.modules[i].register_forward_hook(hook(i))
                   for i in sorted({*self.layers, self.target})]  # fmt: skip
        batch = torch.tensor([ids] * self.dim_batch, dtype=torch.long)
        try:
            forward(self.model, batch.to(input_device(self.model)), None)
        except _Stop:
            pass
        finally:
            for h in handles:
                h.remove()
        self.forward += 1
        return kept[self.target], [kept[i] for i in self.layers]

    def _tell(self, done: int, total: int, unit: str, detail: str = "") -> None:
        if self.progress is not None:
            self.progress("jacobian", done, total, unit, detail)

    def exact(self, usable: list[list[int]], skip: int, skipped: int) -> JacobianFit:
        """The reference's estimator: batched one-hot cotangents, every output dimension."""
        sums: dict[int, torch.Tensor] | None = None
        self._tell(0, len(usable), "sequences")
        for done, ids in enumerate(usable, 1):
            with threads_for(self.model, len(ids) * self.dim_batch):
                one = self._exact_prompt(ids, skip)
            sums = one if sums is None else {k: sums[k] + one[k] for k in sums}
            self._tell(done, len(usable), "sequences")
        assert sums is not None
        n = len(usable)
        return JacobianFit({k: v / n for k, v in sums.items()}, n, skipped, "exact", skip,
                           self.dim_batch, self.backward, self.forward)  # fmt: skip

    def _exact_prompt(self, ids: list[int], skip: int) -> dict[int, torch.Tensor]:
        """One prompt's J at every source layer (float32)."""
        target, sources = self.graph(ids)
        d, m = int(target.shape[-1]), self.dim_batch
        at = torch.arange(skip, len(ids) - 1)
        rows = torch.arange(m)
        out = {layer: torch.zeros(d, d, dtype=torch.float32) for layer in self.layers}
        cotangent = torch.zeros_like(target)
        starts = range(0, d, m)
        for i, start in enumerate(starts):
            n = min(m, d - start)
            cotangent.zero_()
            cotangent[rows[:n, None], at[None, :], start + rows[:n, None]] = 1.0
            grads = self._grad(target, sources, cotangent, i < len(starts) - 1)
            for layer, g in zip(self.layers, grads, strict=True):
                out[layer][start : start + n] = g[:n, at].float().mean(1)
        return out

    def _grad(
        self, target: torch.Tensor, sources: list[torch.Tensor], cot: torch.Tensor, keep: bool
    ) -> tuple[torch.Tensor, ...]:
        self.backward += 1
        grads = torch.autograd.grad(target, sources, cot, retain_graph=keep, allow_unused=True)
        return tuple(torch.zeros_like(s) if g is None else g
                     for g, s in zip(grads, sources, strict=True))  # fmt: skip

    def sketch(
        self,
        usable: list[list[int]],
        skip: int,
        skipped: int,
        how: tuple[int, float, int, str, str],
    ) -> JacobianFit:
        """Random probes, a round at a time, until the halves agree at every layer or `most`
        probes per prompt. Round k brings each prompt to min(2^k, most / dim_batch) backward
        passes, after one forward pass each (a forward pass costs about what a backward pass
        does here: the parameters need no gradient)."""
        most, agree, seed, kind, control = how
        self.vv = [torch.zeros(0), torch.zeros(0)]
        halves = [{layer: torch.zeros(0) for layer in self.layers} for _ in range(2)]
        passes = -(-most // self.dim_batch)
        agreement: dict[int, float] = {}
        done, d, k = 0, _width(self.model), 0
        while done < passes:
            now = min(max(1, done), passes - done)  # 1, 1, 2, 4, ... passes a round
            for p, ids in enumerate(usable):
                v = [
                    self._probes(seed, (p, i, len(usable)), d, kind)
                    for i in range(done, done + now)
                ]
                with threads_for(self.model, len(ids) * self.dim_batch):
                    self._sketch_prompt(ids, skip, v, halves)
            done, k = done + now, k + 1
            parts = self._halves(halves, done * self.dim_batch * len(usable) // 2, control)
            agreement = {layer: _cosine(parts[0][layer], parts[1][layer]) for layer in parts[0]}
            low = min(agreement.values())
            self._tell(done, passes, "passes", f"halves agree at {low:.4f}")
            if low >= agree:
                break
        n, r = len(usable), done * self.dim_batch
        parts = self._halves(halves, n * r // 2, control)
        whole = {layer: (parts[0][layer] + parts[1][layer]) / 2 for layer in self.layers}
        return JacobianFit(whole, n, skipped, "sketch", skip, self.dim_batch, self.backward,
                           self.forward, r, kind, control, agreement,
                           min(agreement.values()) >= agree)  # fmt: skip

    def _sketch_prompt(
        self,
        ids: list[int],
        skip: int,
        probes: list[torch.Tensor],
        halves: list[dict[int, torch.Tensor]],
    ) -> None:
        """One forward pass, then a backward pass per block of dim_batch probes [m, d], added
        to the halves' sums of v (g - v)^T, or v g^T (even probes to half 0, odd to half 1)."""
        target, sources = self.graph(ids)
        at = torch.arange(skip, len(ids) - 1)
        cotangent = torch.zeros_like(target)
        for i, v in enumerate(probes):
            cotangent[:, at, :] = v[:, None, :].to(cotangent.dtype)
            grads = self._grad(target, sources, cotangent, i < len(probes) - 1)
            for h in (0, 1):
                vv = v[h::2].T @ v[h::2]
                self.vv[h] = vv if self.vv[h].numel() == 0 else self.vv[h] + vv
            for layer, g in zip(self.layers, grads, strict=True):
                mean = g[:, at].float().mean(1)
                for h in (0, 1):
                    w = v[h::2]
                    part = w.T @ mean[h::2]
                    sums = halves[h]
                    sums[layer] = part if sums[layer].numel() == 0 else sums[layer] + part

    def _probes(self, seed: int, at: tuple[int, int, int], d: int, kind: str) -> torch.Tensor:
        """The dim_batch probes [m, d] of prompt p's pass i (`at`: p, i, the prompts); half 0's
        are rows 0, 2, ..., half 1's rows 1, 3, .... 'orthogonal': each half's probes, taken in
        the order (pass, prompt), are sqrt(d) times the rows of one random orthogonal matrix
        after another (Haar, seeded), so every d of them sum v v^T to d I exactly."""
        p, i, n = at
        m = self.dim_batch
        if kind != "orthogonal":
            return _probes((seed, p, i), m, d, kind)
        out = torch.empty(m, d)
        first = (i * n + p) * (m // 2)
        for h in (0, 1):
            rows = [self._design(seed, h, (first + j) // d)[(first + j) % d] for j in range(m // 2)]
            out[h::2] = torch.stack(rows) * math.sqrt(d)
        return out

    def _design(self, seed: int, half: int, cycle: int) -> torch.Tensor:
        """Half `half`'s random orthogonal matrix number `cycle` [d, d] (Haar: the Q of a
        Gaussian matrix's QR, its columns' signs fixed by R's diagonal), kept once made."""
        key = (seed, half, cycle)
        if key not in self.designs:
            d = _width(self.model)
            g = _probes((seed, -1 - half, cycle), d, d, "gaussian")
            q, r = torch.linalg.qr(g.double())
            self.designs[key] = (q * torch.sign(torch.diagonal(r))).T.float()
        return self.designs[key]

    def _halves(
        self, halves: list[dict[int, torch.Tensor]], per_half: int, control: str
    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """Each half's estimate of J at every layer: a I + mean of v (g - a v)^T, where a is 0
        ('none'), 1 ('identity'), or ('scaled') tr(J) / d as the other half estimates it (the
        mean of v^T g / d: E[v^T J^T v] = tr J), so that each half stays unbiased."""
        out: tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]] = ({}, {})
        vv = [t / per_half for t in self.vv]
        for layer in self.layers:
            vg = [halves[0][layer] / per_half, halves[1][layer] / per_half]
            d = vg[0].shape[0]
            for h in (0, 1):
                a = _FIXED.get(control, float(torch.trace(vg[1 - h])) / d)
                out[h][layer] = vg[h] - a * vv[h] + a * torch.eye(d)
        return out


_FIXED = {"none": 0.0, "identity": 1.0}


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """The cosine of two matrices, flattened, in float64."""
    x, y = a.double().flatten(), b.double().flatten()
    return float(x @ y / (x.norm() * y.norm()).clamp_min(1e-300))


def _probes(at: tuple[int, int, int], m: int, d: int, kind: str) -> torch.Tensor:
    """m probes [m, d], seeded by `at` (the seed, the prompt, the round): the same seed, the
    same bits."""
    key = hashlib.sha256(("jacobian:" + ":".join(map(str, at))).encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
    if kind == "gaussian":
        return torch.randn(m, d, generator=gen, dtype=torch.float32)
    return torch.randint(0, 2, (m, d), generator=gen).float() * 2 - 1
