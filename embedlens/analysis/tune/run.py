"""One tuning run on a model made ready: the least-squares start from streamed statistics, the
refinement, the held-out evaluation.

Before any statistic is taken, the model's own decoder must reproduce the model's logits from
the last block's output (the lens's self-check): a tuned lens decodes through it, and one fitted
through a tail that is not the model's would not be faithful. The model's parameters are frozen
for the run (only the translators learn) and their flags restored after.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from embedlens.analysis.lens.blocks import find_blocks, input_device
from embedlens.analysis.lens.capture import capture
from embedlens.analysis.lens.decoder import ModelDecoder
from embedlens.analysis.lens.engine import tolerance
from embedlens.analysis.lens.threads import one_thread, threads_for
from embedlens.analysis.lens.tuned import Translators, TunedDecoder
from embedlens.analysis.tune.data import Sequences
from embedlens.analysis.tune.evaluate import evaluate, layer_kl
from embedlens.analysis.tune.fit import LeastSquares
from embedlens.analysis.tune.refine import Recipe, refine
from embedlens.errors import UnsupportedError
from embedlens.reports.tune import TuneLayer
from embedlens.runtime import OthersBusy

Progress = Callable[[str, int, int, str], None]
"""Called as work advances: (phase, done, total, detail), phase 'fitting' (tokens), 'refining'
(steps, the KL of layer bands in the detail) or 'evaluating' (held-out sequences)."""
BUSY_CORES = 0.5
"""Cores other processes keep busy from which the run takes one thread."""
BANDS = 3
"""Layer bands whose mean KL the refinement's progress shows."""


@dataclass(frozen=True)
class Refined:
    """The refinement's outcome: the translators kept, and each layer's KL on the check rows
    before and after it (the refined translator is kept where it is lower)."""

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
    """A run on one model: `fit`, then `refine`, then `evaluate`."""

    def __init__(self, model: nn.Module, progress: Progress | None = None) -> None:
        self.model = model
        self.blocks = find_blocks(model)
        self.n_layers = len(self.blocks.modules)
        self.progress = progress or (lambda phase, done, total, detail: None)
        self.own: ModelDecoder | None = None
        self.vocab_rows = 0
        self.others_busy = OthersBusy()

    def threads(self, n_tokens: int) -> AbstractContextManager[None]:
        """CPU threads for work on n_tokens: one while other processes keep half a core busy or
        more (a tuning run is minutes of matrix products, each ending in a barrier that waits
        for a time slice on busy cores: measured on 2 cores at load 5, one thread took 201 CPU
        seconds where two took 481), else as the lens chooses (one for small work). The figures
        do not depend on it: matrix products and row-wise reductions give the same bits on any
        number of threads, and sums to one value are taken on one thread."""
        if torch.get_num_threads() > 1 and self.others_busy() >= BUSY_CORES:
            return one_thread()
        return threads_for(self.model, n_tokens)

    def fit(self, data: Sequences) -> Translators:
        """The least-squares translators over every sequence of `data` (streamed)."""
        stats: LeastSquares | None = None
        for s, ids in enumerate(data.ids, 1):
            with torch.inference_mode(), self.threads(len(ids)):
                if self.own is None:
                    self._self_check(ids)
                cap = capture(
                    self.model, self.blocks, [ids], [list(range(len(ids)))],
                    range(self.n_layers + 1), logits=False,
                )  # fmt: skip
                if stats is None:
                    stats = LeastSquares(self.n_layers, int(cap.residual[0].shape[-1]))
                stats.add(cap.residual)
                self.progress("fitting", s * data.seq_len, data.tokens, "")
        assert stats is not None
        return stats.solve()

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
        assert self.own is not None
        before = layer_kl(self.model, self.blocks, TunedDecoder(self.own, start), check,
                          self.threads)  # fmt: skip
        refined = self._refined(start, data, recipe, seed)
        after = layer_kl(self.model, self.blocks, TunedDecoder(self.own, refined), check,
                         self.threads)  # fmt: skip
        better = [layer for layer in range(self.n_layers) if after[layer] < before[layer]]
        keep = torch.tensor([layer in better for layer in range(self.n_layers)])
        weight = torch.where(keep[:, None, None], refined.weight, start.weight)
        bias = torch.where(keep[:, None], refined.bias, start.bias)
        return Refined(Translators(weight, bias), better, before, after)

    def _refined(
        self, start: Translators, data: Sequences, recipe: Recipe, seed: int
    ) -> Translators:
        assert self.own is not None
        bands = _bands(self.n_layers)

        def on_step(step: int, steps: int, kls: list[float]) -> None:
            shown = ", ".join(
                f"{lo}-{hi} {sum(kls[lo : hi + 1]) / (hi - lo + 1):.3f}" for lo, hi in bands
            )
            self.progress("refining", step, steps, f"KL by layers {shown}")

        with _frozen(self.model):
            return refine(
                self.model, self.blocks, self.own, start, data, recipe, seed,
                on_step=on_step, threads=self.threads,
            )  # fmt: skip

    def evaluate(self, translators: Translators, data: Sequences) -> list[TuneLayer]:
        """Per layer, the logit lens and the tuned lens on held-out `data`."""
        assert self.own is not None
        tuned = TunedDecoder(self.own, translators)

        def on_sequence(done: int, total: int) -> None:
            self.progress("evaluating", done * data.seq_len, total * data.seq_len, "")

        return evaluate(
            self.model, self.blocks, self.own, tuned, data, on_sequence, threads=self.threads
        )


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
