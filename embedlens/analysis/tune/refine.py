"""The refinement: every translator trained to minimise KL(model's output ‖ translated lens),
with tuned-lens's recipe.

tuned-lens's `train_loop` and `ingredients.Optimizer`: SGD with Nesterov momentum 0.9 and a
learning rate of lr × (1 - momentum) (PyTorch's momentum scales steps by 1 / (1 - momentum), so
lr 1 is a step of one gradient), weight decay 1e-3 on W and b (which, as the translator is added
to h, pulls it toward the identity), the learning rate decayed linearly to 0 over the steps,
gradients clipped to norm 1 before each step (each translator's on its own: see `_clip`). The loss of a step is the sum
over layers of the mean KL over its rows; each layer's backward pass runs on its own, so one
layer's graph (rows x vocabulary) is held at a time. Rows are drawn in a seeded order: the same
data and seed give the same translators.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from embedlens.analysis.lens.blocks import ModelDecoder, one_thread, threads_for
from embedlens.analysis.lens.decoders import Translators
from embedlens.analysis.tune.data import Sequences
from embedlens.errors import NumericError

if TYPE_CHECKING:
    from embedlens.analysis.dist import Session
    from embedlens.analysis.tune.reading import Reader
    from embedlens.progress import Progress

GRAPH_ROWS = 64
"""Rows one backward pass runs on (a step's rows are split into such parts)."""
BANDS = 3
"""Layer bands whose mean KL the refinement's progress shows."""


@dataclass(frozen=True)
class Recipe:
    """tuned-lens's optimiser settings (`ingredients.Optimizer`), with the steps to take."""

    rows: int
    """Rows (tokens) the refinement reads in all."""
    steps: int
    lr: float = 1.0
    """tuned-lens's `lr_scale`: SGD's learning rate is lr × (1 - momentum)."""
    momentum: float = 0.9
    weight_decay: float = 1e-3
    clip: float = 1.0


@dataclass(frozen=True)
class _Rows:
    """Rows of the residual stream at layers 0..L-1, and the model's log-probabilities there."""

    residual: list[torch.Tensor]
    target: torch.Tensor

    def __len__(self) -> int:
        return int(self.target.shape[0])

    def part(self, start: int, stop: int) -> _Rows:
        """Rows start..stop."""
        return _Rows([r[start:stop] for r in self.residual], self.target[start:stop])

    def take(self, n: int) -> tuple[_Rows, _Rows]:
        """The first n rows, and the rest."""
        head = _Rows([r[:n] for r in self.residual], self.target[:n])
        return head, _Rows([r[n:] for r in self.residual], self.target[n:])

    def join(self, other: _Rows) -> _Rows:
        if len(self) == 0:
            return other
        residual = [torch.cat([a, b]) for a, b in zip(self.residual, other.residual, strict=True)]
        return _Rows(residual, torch.cat([self.target, other.target]))


def refine(
    reader: Reader,
    start: Translators,
    data: Sequences,
    recipe: Recipe,
    seed: int,
    *,
    progress: Progress | None = None,
    session: Session | None = None,
) -> Translators:
    """The translators after `recipe.steps` steps over `recipe.rows` rows of `data`, from
    `start`, through the model's own decoder (`reader.own`, checked); `progress` shows each
    step's KL by bands of layers. Under torchrun (`session`) every process reads the same rows,
    takes its part of each step's and the step's gradient and KL are summed over processes:
    each then takes the same step (the sum of every part is the whole step's, up to the order
    of float sums)."""
    own, device = reader.own, reader.device
    weight = nn.Parameter(start.weight.clone().to(device))
    bias = nn.Parameter(start.bias.clone().to(device))
    opt = _Nesterov([weight, bias], recipe)
    steps = recipe.steps
    bands = _bands(reader.n_layers)
    sizes = [recipe.rows * (k + 1) // steps - recipe.rows * k // steps for k in range(steps)]
    for step, rows in enumerate(_batches(reader, data, sizes, seed), 1):
        mine = rows if session is None else rows.part(*session.part(len(rows)))
        with threads_for(reader.model, len(mine)):
            kls = _step(own, weight, bias, mine, len(rows))
        if session is not None:
            kls = _summed(session, weight, bias, kls)
        if not all(math.isfinite(k) for k in kls):
            raise NumericError(
                f"the refinement diverged at step {step} (the KL is not finite)",
                hint="try a smaller --lr, or --method affine",
            )
        _clip(weight, bias, recipe.clip)
        opt.step(max(0.0, 1 - (step - 1) / steps))
        if progress is not None:
            progress("refining", step, steps, "steps", f"KL by layers {_by_bands(kls, bands)}")
    return Translators(weight.detach().float().cpu(), bias.detach().float().cpu())


def _bands(n_layers: int) -> list[tuple[int, int]]:
    """Layers 0..n_layers-1 in BANDS ranges of about equal size."""
    edges = [round(i * n_layers / BANDS) for i in range(BANDS + 1)]
    return [(edges[i], edges[i + 1] - 1) for i in range(BANDS) if edges[i + 1] > edges[i]]


def _by_bands(kls: list[float], bands: list[tuple[int, int]]) -> str:
    """Each band's mean KL, as progress shows them."""
    return ", ".join(f"{lo}-{hi} {sum(kls[lo : hi + 1]) / (hi - lo + 1):.3f}" for lo, hi in bands)


class _Nesterov:
    """torch.optim.SGD's update with Nesterov momentum and weight decay (dampening 0), done in
    place on each parameter and its gradient: SGD's own allocates a parameter-sized array or
    two per step, as large as all translators."""

    def __init__(self, params: list[nn.Parameter], recipe: Recipe) -> None:
        self.params = params
        self.recipe = recipe
        self.momentum = [torch.zeros_like(p) for p in params]

    def step(self, scale: float) -> None:
        """One step at the learning rate lr × (1 - momentum) × scale; gradients zeroed after."""
        r = self.recipe
        lr = r.lr * (1 - r.momentum) * scale
        with torch.no_grad():
            for p, buf in zip(self.params, self.momentum, strict=True):
                assert p.grad is not None
                g = p.grad.add_(p, alpha=r.weight_decay)
                buf.mul_(r.momentum).add_(g)
                p.add_(g.add_(buf, alpha=r.momentum), alpha=-lr)
                p.grad.zero_()


def _clip(weight: torch.Tensor, bias: torch.Tensor, limit: float) -> None:
    """Each layer's gradient (its W and b together) scaled down to norm `limit` when above it.

    tuned-lens clips all translators' gradient as one, which is right for its hundreds of steps
    from the identity; from the least-squares start, the large gradients of a few layers would
    set every layer's step. Norms are taken on one thread (a sum to one value would otherwise
    depend on the number of threads in its last bits)."""
    assert weight.grad is not None and bias.grad is not None
    with one_thread():
        for layer in range(weight.shape[0]):
            w, b = weight.grad[layer], bias.grad[layer]
            norm = math.hypot(float(w.double().norm()), float(b.double().norm()))
            if norm > limit:
                scale = limit / (norm + 1e-6)
                w.mul_(scale)
                b.mul_(scale)


def _summed(
    session: Session, weight: torch.Tensor, bias: torch.Tensor, kls: list[float]
) -> list[float]:
    """Every process's part of a step added: the gradients (in place) and each layer's KL."""
    for p in (weight, bias):
        if p.grad is None:  # a process whose part of the step had no row
            p.grad = torch.zeros_like(p)
        session.all_reduce_(p.grad)
    return session.sum_floats(kls)


def _step(
    own: ModelDecoder, weight: torch.Tensor, bias: torch.Tensor, rows: _Rows, total: int
) -> list[float]:
    """Every layer's KL on the rows, summed and divided by the step's `total` rows, its gradient
    added to the translators': one layer's graph at a time, over GRAPH_ROWS rows at a time (a
    graph holds a few [rows, V] arrays)."""
    n = total
    kls = [0.0] * len(rows.residual)
    for start in range(0, len(rows), GRAPH_ROWS):
        target = rows.target[start : start + GRAPH_ROWS]
        p = target.exp()
        for layer, h in enumerate(rows.residual):
            x = h[start : start + GRAPH_ROWS].float()
            translated = x + torch.addmm(bias[layer], x, weight[layer].T)
            lq = torch.log_softmax(own.logits(translated.to(h.dtype)).float(), dim=-1)
            loss = (p * (target - lq)).sum(-1).sum() / n
            loss.backward()  # type: ignore[no-untyped-call]
            kls[layer] += float(loss.detach())
    return kls


def _batches(reader: Reader, data: Sequences, sizes: list[int], seed: int) -> Iterator[_Rows]:
    """Batches of rows of the given sizes, each sequence's rows in a seeded order (a batch may
    take rows from two sequences); only the sequences needed are run."""
    generator = torch.Generator().manual_seed(seed)
    pending: _Rows | None = None
    wanted = iter(sizes)
    size = next(wanted, None)
    for ids in data.ids:
        if size is None:
            return
        rows = _sequence_rows(reader, ids, generator)
        pending = rows if pending is None else pending.join(rows)
        while size is not None and len(pending) >= size:
            batch, pending = pending.take(size)
            yield batch
            size = next(wanted, None)
    if size is not None and pending is not None and len(pending) > 0:
        yield pending


def _sequence_rows(reader: Reader, ids: list[int], generator: torch.Generator) -> _Rows:
    """One sequence's residual rows (layers 0..L-1) and the model's log-probabilities, in a
    seeded order (without inference mode, whose tensors could not enter the refinement's
    graph; the model's parameters are frozen, so no graph is built here). One [tokens, V] array
    of log-probabilities is kept; at most two exist at once."""
    n_layers = reader.n_layers
    with reader.read(ids, graph=True) as cap:
        assert cap.logits is not None
        order = torch.randperm(len(ids), generator=generator)
        logits, cap.logits = cap.logits, None
        target = torch.log_softmax(logits, dim=-1)
        del logits
        target = target[order.to(target.device)]
        residual = [cap.residual[i][order.to(cap.residual[i].device)] for i in range(n_layers)]
    return _Rows(residual, target)
