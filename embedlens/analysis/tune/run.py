"""One tuning run on a model made ready: the least-squares start from streamed statistics, the
refinement, the held-out evaluation.

Before any statistic is taken, the model's own decoder must reproduce the model's logits from
the last block's output (the lens's self-check): a tuned lens decodes through it, and one fitted
through a tail that is not the model's would not be faithful. The model's parameters are frozen
for the run (only the translators learn) and their flags restored after.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from embedlens.analysis.lens.blocks import ModelDecoder, capture, find_blocks, input_device
from embedlens.analysis.lens.engine import tolerance
from embedlens.analysis.lens.threads import threads_for
from embedlens.analysis.lens.tuned import Translators, TunedDecoder
from embedlens.analysis.tune.data import Sequences
from embedlens.analysis.tune.evaluate import evaluate, layer_kl
from embedlens.analysis.tune.fit import LeastSquares
from embedlens.analysis.tune.refine import Recipe, refine
from embedlens.errors import UnsupportedError
from embedlens.progress import no_progress
from embedlens.reports.tune import TuneLayer

if TYPE_CHECKING:
    from embedlens.analysis.dist import Session
    from embedlens.progress import Progress

BANDS = 3
"""Layer bands whose mean KL the refinement's progress shows."""
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
    refined: Refined | None = None
    """None with --method affine."""


class Tuning:
    """A run on one model: `fit`, then `refine`, then `evaluate`; under torchrun (`session`),
    split over processes: each fits and evaluates its share of the sequences (the sums added
    over processes), and takes its part of each refinement step's rows (the gradients added)."""

    def __init__(
        self, model: nn.Module, progress: Progress | None = None, session: Session | None = None
    ) -> None:
        self.model = model
        self.session = session
        self.blocks = find_blocks(model)
        self.n_layers = len(self.blocks.modules)
        self.progress: Progress = progress or no_progress
        self.own: ModelDecoder | None = None
        self.vocab_rows = 0
        self._counts: dict[str, int] = {}
        self.threads: Callable[[int], AbstractContextManager[None]] = functools.partial(
            threads_for, model
        )
        """CPU threads for work on n tokens, as the lens chooses them (one for small work): from
        the work's size alone, never from the machine's load, so that the lens folder's bytes
        do not depend on what else the machine runs (on 2 busy cores at load 5, two threads
        took 481 CPU seconds where one took 201: set OMP_NUM_THREADS=1 on a shared machine)."""

    def fit(self, data: Sequences) -> Translators:
        """The least-squares translators over every sequence of `data` (streamed)."""
        stats: LeastSquares | None = None
        for s in self._share(len(data)):
            ids = data.ids[s]
            with torch.inference_mode(), self.threads(len(ids)):
                if self.own is None:
                    self._self_check(ids)
                cap = capture(
                    self.model, self.blocks, [ids], [list(range(len(ids)))],
                    range(self.n_layers + 1), logits=False,
                )  # fmt: skip
                if stats is None:
                    stats = self._sums(cap.residual)
                stats.add(cap.residual)
            self.progress("fitting", self._done("fitting", data.seq_len), data.tokens, "tokens")
        if self.session is not None:
            if self.own is None:  # a process without a sequence of its own
                with torch.inference_mode(), self.threads(len(data.ids[0])):
                    self._self_check(data.ids[0])
            stats = stats or self._sums(None)
            stats.reduce(self.session.all_reduce_)
        assert stats is not None
        return stats.solve()

    def _share(self, n: int) -> range:
        """The sequences this process runs, of n (all of them alone)."""
        return range(n) if self.session is None else self.session.share(n)

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
        if self.session is None:
            assert residual is not None
            return LeastSquares(self.n_layers, int(residual[0].shape[-1]))
        shift = None
        if self.session.rank == 0:
            assert residual is not None
            shift = LeastSquares.means(residual, self.n_layers)
        shift_x, shift_y = self.session.broadcast(shift)
        return LeastSquares(self.n_layers, int(shift_y.shape[-1]), shift=(shift_x, shift_y))

    def _self_check(self, ids: list[int]) -> None:
        """The model's own decoder reproduces its logits from the last block's output (cutting
        the block list, else with every block in place), or UnsupportedError."""
        model, n = self.model, self.n_layers
        cap = capture(model, self.blocks, [ids], [list(range(len(ids)))], [n])
        assert cap.logits is not None
        self.vocab_rows = int(cap.logits.shape[-1])
        own = ModelDecoder(model, self.blocks, dummy_id=int(ids[0]))
        tol = tolerance(next(model.parameters()).dtype, cap.logits)
        diff = math.inf
        for full in (False, True):
            own.full = full
            rows = cap.residual[n][:16].to(input_device(model))
            mine = own.logits(rows, [n] * len(rows)).float().to(cap.logits.device)
            diff = float((mine - cap.logits[: len(rows)]).abs().max())
            if diff <= tol:
                self.own = own
                return
        raise UnsupportedError(
            f"decoding the last block's output does not reproduce this model's logits (max |Δ| "
            f"= {diff:.3g} > {tol:.3g}): a lens decoded through the model's own steps would not "
            "be faithful, so none is tuned",
            hint="`embedlens lens MODEL PROMPT` names the suspect step",
        )

    def refine(
        self, start: Translators, data: Sequences, check: Sequences, recipe: Recipe, seed: int
    ) -> Refined:
        """The translators refined on `recipe.rows` rows of `data` (KL to the model's output),
        each layer's kept only where it beats its start on `check` (rows not trained on)."""
        before = self._check_kl(start, check)
        refined = self._refined(start, data, recipe, seed)
        after = self._check_kl(refined, check)
        if self.session is not None:  # rank 0's figures, so that every process keeps the same
            before, after = self.session.broadcast((before, after))
        better = [layer for layer in range(self.n_layers) if _better(before[layer], after[layer])]
        keep = torch.tensor([layer in better for layer in range(self.n_layers)])
        weight = torch.where(keep[:, None, None], refined.weight, start.weight)
        bias = torch.where(keep[:, None], refined.bias, start.bias)
        return Refined(Translators(weight, bias), better, before, after)

    def _check_kl(self, translators: Translators, check: Sequences) -> list[float]:
        """Each layer's KL through `translators` on the check rows (on rank 0 alone under
        torchrun: the others get its figures)."""
        assert self.own is not None
        if self.session is not None and self.session.rank != 0:
            return []
        decoder = TunedDecoder(self.own, translators)
        return layer_kl(self.model, self.blocks, decoder, check, self.threads)

    def _refined(
        self, start: Translators, data: Sequences, recipe: Recipe, seed: int
    ) -> Translators:
        assert self.own is not None
        bands = _bands(self.n_layers)

        def on_step(step: int, steps: int, kls: list[float]) -> None:
            shown = ", ".join(
                f"{lo}-{hi} {sum(kls[lo : hi + 1]) / (hi - lo + 1):.3f}" for lo, hi in bands
            )
            self.progress("refining", step, steps, "steps", f"KL by layers {shown}")

        with _frozen(self.model):
            return refine(
                self.model, self.blocks, self.own, start, data, recipe, seed,
                on_step=on_step, threads=self.threads, session=self.session,
            )  # fmt: skip

    def evaluate(self, translators: Translators, data: Sequences) -> list[TuneLayer]:
        """Per layer, the logit lens and the tuned lens on held-out `data`."""
        assert self.own is not None
        tuned = TunedDecoder(self.own, translators)

        def on_sequence(done: int, total: int) -> None:
            self.progress(
                "evaluating", self._done("evaluating", data.seq_len), data.tokens, "tokens"
            )

        return evaluate(
            self.model, self.blocks, self.own, tuned, data, on_sequence, threads=self.threads,
            session=self.session,
        )  # fmt: skip


def _better(before: float, after: float) -> bool:
    """The refined translator lowers the KL by more than rounding could (KEEP_MARGIN)."""
    return after < before - KEEP_MARGIN * abs(before) - KEEP_FLOOR


def _bands(n_layers: int) -> list[tuple[int, int]]:
    """Layers 0..n_layers-1 in BANDS ranges of about equal size."""
    edges = [round(i * n_layers / BANDS) for i in range(BANDS + 1)]
    return [(edges[i], edges[i + 1] - 1) for i in range(BANDS) if edges[i + 1] > edges[i]]


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
