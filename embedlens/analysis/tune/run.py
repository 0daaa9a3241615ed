"""One tuning run on a model made ready (`tune_model`): the least-squares start from streamed
statistics, the refinement, the held-out evaluation.

Before any statistic is taken, the model's own decoder must reproduce the model's logits from
the last block's output (the `Reader`, made on the first sequence fitted). The model's
parameters are frozen for the refinement (only the translators learn) and their flags restored
after.

The closed-form start (`LeastSquares`): for each layer l, the least-squares affine map from its
residual to the last layer's, from sufficient statistics streamed over the data.

For residual rows x (layer l) and y (layer L), the translator minimises Σ |y - (x + W x + b)|²
+ λ n |W|² (ridge toward the identity, as weight decay is in the refinement): with the
covariances C_xx and C_xy, Wᵀ = (C_xx + λ I)⁻¹ (C_xy - C_xx) and b = mean(y) - mean(x) - W mean(x).
Per layer only the sums of x, y, x xᵀ and x yᵀ are kept, taken after subtracting the first
batch's means (so that the residual stream's large mean does not cancel the digits of its
spread): memory does not grow with the tokens read. Each batch's d x d products are float32, their
running sums float64, as are the vectors and the solve: the solve turns a change in the last bits
of float32 sums (1e-7 of an entry) into one of 1e-4 in SmolLM2's translators, so summed in
float32 the lens would follow the order of the sums (another in a run split over processes, which
adds its parts' sums).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from embedlens.analysis.lens.decoders import Translators
from embedlens.analysis.tune.data import Sequences
from embedlens.analysis.tune.evaluate import evaluate, layer_kl
from embedlens.analysis.tune.reading import Reader
from embedlens.analysis.tune.refine import Recipe, refine
from embedlens.reports.tune import TuneLayer

if TYPE_CHECKING:
    from embedlens.analysis.dist import Session
    from embedlens.analysis.lens.blocks import Blocks
    from embedlens.analysis.lens.jacobian import Transport
    from embedlens.analysis.tune.data import Plan
    from embedlens.progress import Progress

RIDGE = 1e-4
"""λ, relative to the mean variance of the layer's residual (trace(C_xx) / d)."""

KEEP_MARGIN = 1e-4
KEEP_FLOOR = 1e-6
"""A refined translator is kept where it lowers the check rows' KL by more than KEEP_MARGIN of
it plus KEEP_FLOOR nats: a smaller change is float rounding, whose last bits follow the order
of the sums (a run split over processes adds in another order), and would make the choice a
coin toss between two translators."""


@dataclass(frozen=True)
class Refined:
    """The refinement's outcome: the translators kept, and each layer's KL on the check rows
    before and after it (the refined translator is kept where it is lower by more than
    rounding: KEEP_MARGIN)."""

    translators: Translators
    refined_layers: list[int]
    kl_before: list[float]
    kl_after: list[float]


@dataclass(frozen=True)
class Fitted:
    """What the run produced: the translators, the evaluation, and facts for the lens folder."""

    translators: Translators
    layers: list[TuneLayer]
    vocab_rows: int
    """Rows of the model's output."""
    blocks: Blocks
    """The model's decoder blocks, as the run found them (the decoder's fingerprint leaves
    them out: `match.identify`)."""
    refined: Refined | None = None
    """None with --method affine."""


def tune_model(
    model: nn.Module,
    the_plan: Plan,
    recipe: Recipe | None,
    seed: int,
    progress: Progress | None = None,
    session: Session | None = None,
    jacobian: Callable[[nn.Module], Transport] | None = None,
) -> Fitted:
    """Fit on the plan's sequences, refine by `recipe` (none with --method affine) and evaluate
    on those held out (split over the processes of `session`); `jacobian` fits the Jacobian lens
    too (before the evaluation, which reads it beside the tuned lens)."""
    run = Tuning(model, progress, session)
    translators = run.fit(the_plan.fit)
    refined = None
    if recipe is not None:
        refined = run.refine(translators, the_plan.refine, the_plan.check, recipe, seed)
        translators = refined.translators
    if jacobian is None:
        layers = run.evaluate(translators, the_plan.held_out)
    else:
        layers = run.evaluate(translators, the_plan.held_out, jacobian(model))
    return Fitted(translators, layers, run.reader.vocab_rows, run.reader.blocks, refined)


class Tuning:
    """A run on one model: `fit`, then `refine`, then `evaluate`; under torchrun (`session`),
    split over processes: each fits and evaluates its share of the sequences (the sums added
    over processes), and takes its part of each refinement step's rows (the gradients added)."""

    reader: Reader
    """The model as the run reads it, made by `fit` on the first sequence fitted (on every
    process the same one, so that all find the model's own decoder faithful or none does)."""

    def __init__(
        self, model: nn.Module, progress: Progress | None = None, session: Session | None = None
    ) -> None:
        self.model = model
        self.session = session
        self.progress = progress
        self._counts: dict[str, int] = {}

    def _tell(self, stage: str, done: int, total: int, unit: str, *detail: str) -> None:
        """The run's progress, where one is shown."""
        if self.progress is not None:
            self.progress(stage, done, total, unit, *detail)

    def fit(self, data: Sequences) -> Translators:
        """The least-squares translators over every sequence of `data` (streamed), once the
        model's own decoder is checked on the first."""
        self.reader = reader = Reader(self.model, data.ids[0])
        stats: LeastSquares | None = None
        for s in self._share(data):
            with reader.read(data.ids[s], logits=False) as cap:
                if stats is None:
                    stats = self._sums(cap.residual)
                stats.add(cap.residual)
            self._advance("fitting", data)
        if self.session is not None:
            stats = stats or self._sums(None)  # a process without a sequence of its own
            stats.reduce(self.session.all_reduce_)
        assert stats is not None
        n_layers = stats.num_layers
        return stats.solve(on_layer=lambda done: self._tell("solving", done, n_layers, "layers"))

    def _share(self, data: Sequences) -> range:
        """The sequences of `data` this process runs (all of them alone)."""
        n = len(data.ids)
        return range(n) if self.session is None else self.session.share(n)

    def _advance(self, phase: str, data: Sequences) -> None:
        """The progress of a phase counted in tokens: one more sequence of `data` done."""
        self._tell(phase, self._done(phase, data.seq_len), data.tokens, "tokens")

    def _done(self, phase: str, n: int) -> int:
        """Tokens done so far in a phase, over every process (`n` more by this one)."""
        if self.session is None:
            self._counts[phase] = self._counts.get(phase, 0) + n
            return self._counts[phase]
        self.session.check()
        return self.session.total(phase, n)

    def _sums(self, residual: dict[int, torch.Tensor] | None) -> LeastSquares:
        """The least-squares sums, shifted by the first sequence's means: under torchrun, rank
        0's (the run's first sequence), which every process takes."""
        n_layers = self.reader.n_layers
        if self.session is None:
            assert residual is not None
            return LeastSquares(n_layers, int(residual[0].shape[-1]))
        shift = None
        if self.session.rank == 0:
            assert residual is not None
            shift = LeastSquares.means(residual, n_layers)
        shift_x, shift_y = self.session.broadcast(shift)
        return LeastSquares(n_layers, int(shift_y.shape[-1]), shift=(shift_x, shift_y))

    def refine(
        self, start: Translators, data: Sequences, check: Sequences, recipe: Recipe, seed: int
    ) -> Refined:
        """The translators refined on `recipe.rows` rows of `data` (KL to the model's output),
        each layer's kept only where it beats its start on `check` (rows not trained on)."""
        before = self._check_kl(start, check, "the fitted translators")
        self._tell("refining", 0, recipe.steps, "steps")
        refined = self._refined(start, data, recipe, seed)
        after = self._check_kl(refined, check, "the refined translators")
        if self.session is not None:  # rank 0's figures, so that every process keeps the same
            before, after = self.session.broadcast((before, after))
        n_layers = self.reader.n_layers
        better = [layer for layer in range(n_layers) if _better(before[layer], after[layer])]
        keep = torch.tensor([layer in better for layer in range(n_layers)])
        weight = torch.where(keep[:, None, None], refined.weight, start.weight)
        bias = torch.where(keep[:, None], refined.bias, start.bias)
        return Refined(Translators(weight, bias), better, before, after)

    def _check_kl(self, translators: Translators, check: Sequences, which: str) -> list[float]:
        """Each layer's KL through `translators` (`which`, as progress names them) on the check
        rows (on rank 0 alone under torchrun: the others get its figures)."""
        if self.session is not None and self.session.rank != 0:
            return []
        return layer_kl(self.reader, translators, check, progress=self.progress, which=which)

    def _refined(
        self, start: Translators, data: Sequences, recipe: Recipe, seed: int
    ) -> Translators:
        with _frozen(self.model):
            return refine(
                self.reader, start, data, recipe, seed, progress=self.progress, session=self.session
            )

    def evaluate(
        self, translators: Translators, data: Sequences, jacobian: Transport | None = None
    ) -> list[TuneLayer]:
        """Per layer, the logit lens and the tuned lens (and the Jacobian lens) on held-out
        `data`."""

        def on_sequence() -> None:
            self._advance("evaluating", data)

        return evaluate(
            self.reader, translators, data, self._share(data), on_sequence,
            session=self.session, jacobian=jacobian,
        )  # fmt: skip


def _better(before: float, after: float) -> bool:
    """The refined translator lowers the KL by more than rounding could (KEEP_MARGIN)."""
    return after < before - KEEP_MARGIN * abs(before) - KEEP_FLOOR


@contextmanager
def _frozen(model: nn.Module) -> Iterator[None]:
    """No gradient for the model's parameters inside (only the translators learn); each
    parameter's flag restored after."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


class LeastSquares:
    """Streamed sums for the least-squares translators of layers 0..L-1."""

    def __init__(
        self, num_layers: int, width: int, shift: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        """`shift`: the means subtracted (`means`), else the first batch's."""
        self.num_layers = num_layers
        self.width = width
        self.n = 0
        self.shift_x: torch.Tensor | None = None if shift is None else shift[0]
        self.shift_y: torch.Tensor | None = None if shift is None else shift[1]
        self.sum_x = torch.zeros(num_layers, width, dtype=torch.float64)
        self.sum_y = torch.zeros(width, dtype=torch.float64)
        self.xx = torch.zeros(num_layers, width, width, dtype=torch.float64)
        self.xy = torch.zeros(num_layers, width, width, dtype=torch.float64)

    @staticmethod
    def means(
        residual: dict[int, torch.Tensor], num_layers: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch's means at layers 0..L-1 ([L, d]) and at layer L ([d]): the shift."""
        x = torch.stack([residual[i].detach().float().cpu().mean(0) for i in range(num_layers)])
        return x, residual[num_layers].detach().float().cpu().mean(0)

    def add(self, residual: dict[int, torch.Tensor]) -> None:
        """Rows of one batch: residual[l] is [n, d] at layer l (0..L), the same rows at each."""
        last = residual[self.num_layers].detach().float().cpu()
        if self.shift_x is None:
            self.shift_x, self.shift_y = self.means(residual, self.num_layers)
        assert self.shift_x is not None and self.shift_y is not None
        y = last - self.shift_y
        self.n += int(y.shape[0])
        self.sum_y += y.sum(0, dtype=torch.float64)
        for layer in range(self.num_layers):
            x = residual[layer].detach().float().cpu() - self.shift_x[layer]
            self.sum_x[layer] += x.sum(0, dtype=torch.float64)
            self.xx[layer] += x.T @ x
            self.xy[layer] += x.T @ y

    def reduce(self, all_reduce: Callable[[torch.Tensor], None]) -> None:
        """The sums of every process added (`all_reduce` sums a tensor over them in place; the
        shift must be the same in each)."""
        count = torch.tensor([self.n], dtype=torch.float64)
        for total in (count, self.sum_x, self.sum_y, self.xx, self.xy):
            all_reduce(total)
        self.n = int(count)

    def solve(
        self, ridge: float = RIDGE, on_layer: Callable[[int], None] | None = None
    ) -> Translators:
        """The translators that minimise the squared error (with the ridge toward identity);
        `on_layer(done)` after each layer's."""
        assert self.n > 0 and self.shift_x is not None and self.shift_y is not None
        d, n = self.width, self.n
        weight = torch.zeros(self.num_layers, d, d, dtype=torch.float32)
        bias = torch.zeros(self.num_layers, d, dtype=torch.float32)
        mean_y = self.sum_y / n
        eye = torch.eye(d, dtype=torch.float64)
        for layer in range(self.num_layers):
            mean_x = self.sum_x[layer] / n
            cxx = self.xx[layer] / n - torch.outer(mean_x, mean_x)
            cxy = self.xy[layer] / n - torch.outer(mean_x, mean_y)
            reg = ridge * float(torch.trace(cxx)) / d + 1e-12
            wt = _solve(cxx + reg * eye, cxy - cxx)
            w = wt.T
            x0 = mean_x + self.shift_x[layer].double()
            y0 = mean_y + self.shift_y.double()
            weight[layer] = w.float()
            bias[layer] = (y0 - x0 - w @ x0).float()
            if on_layer is not None:
                on_layer(layer + 1)
        return Translators(weight, bias)


def _solve(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a⁻¹ b for a symmetric positive semi-definite a (its pseudo-inverse when singular)."""
    try:
        out: torch.Tensor = torch.linalg.solve(a, b)
    except RuntimeError:  # torch.linalg.LinAlgError: a singular matrix
        out = torch.linalg.pinv(a, hermitian=True) @ b
    return out
