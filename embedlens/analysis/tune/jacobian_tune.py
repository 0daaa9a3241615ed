"""`tune --jacobian`: the Jacobian lens fitted beside the tuned lens, on the first of the same
fitting sequences, written into the lens folder as `jacobian_lens.pt` (the reference's format,
`analysis/lens/jacobian.py`) and evaluated on the same held-out text.

Its own token budget (`JACOBIAN_TOKENS`): the exact estimator costs ceil(d / 8) backward passes
of 8 copies of each sequence (on SmolLM2, d = 576: 72 passes of 8 x 512 tokens for one sequence
of 512, minutes of a CPU core), so the default is one sequence's worth of tokens (the sketch, with
at most 1/8 of those passes, can afford more: `--jacobian-tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from embedlens.errors import UsageError

if TYPE_CHECKING:
    from torch import nn

    from embedlens.analysis.lens.jacobian import Transport
    from embedlens.analysis.tune.data import Plan
    from embedlens.analysis.tune.jacobian import JacobianFit
    from embedlens.progress import Progress
    from embedlens.reports.tune import JacobianFitted

FILE = "jacobian_lens.pt"
"""The artifact's name in the lens folder."""
JACOBIAN_TOKENS = 512
"""The default tokens fitted: one sequence of the default length."""


@dataclass(frozen=True)
class JacobianAsk:
    """What `tune --jacobian` asks for, checked."""

    estimator: str
    probes: int | None
    skip_first: int
    tokens: int
    agree: float


def jacobian_ask(
    jacobian: bool,
    estimator: str | None,
    probes: int | None,
    skip_first: int | None,
    tokens: int | None,
    *,
    split: bool = False,
) -> JacobianAsk | None:
    """The Jacobian lens's options checked (None without --jacobian, which refuses them; refused
    under torchrun, `split`: the fit runs in one process)."""
    from embedlens.analysis.tune.jacobian import AGREE, ESTIMATORS, SKIP_FIRST

    given = [name for name, value in (("--estimator", estimator), ("--probes", probes),
             ("--skip-first", skip_first), ("--jacobian-tokens", tokens)) if value is not None]  # fmt: skip
    if not jacobian:
        if given:
            raise UsageError(
                f"{', '.join(given)} apply to the Jacobian lens: add --jacobian, or leave them out"
            )
        return None
    if split:
        raise UsageError("--jacobian runs in one process: run tune without torchrun")
    how = "exact" if estimator is None else estimator
    if how not in ESTIMATORS:
        raise UsageError(f"unknown --estimator {how!r}", hint="use one of: exact, sketch")
    if how == "exact" and probes is not None:
        raise UsageError("--probes applies to --estimator sketch: the exact estimator has none")
    if probes is not None and (_int(probes) is None or probes < 2 or probes % 2):
        raise UsageError(f"--probes must be an even integer of at least 2, not {probes!r}")
    skip = SKIP_FIRST if skip_first is None else skip_first
    if _int(skip) is None or skip < 0:
        raise UsageError(f"--skip-first must be a non-negative integer, not {skip_first!r}")
    budget = JACOBIAN_TOKENS if tokens is None else tokens
    if _int(budget) is None or budget < 1:
        raise UsageError(f"--jacobian-tokens must be a positive integer, not {tokens!r}")
    return JacobianAsk(how, probes, skip, budget, AGREE)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_plan(ask: JacobianAsk, the_plan: Plan) -> None:
    """--skip-first must leave a valid position in the sequences (checked before the weights
    load: every sequence has the plan's length)."""
    n = the_plan.seq_len
    if ask.skip_first + 2 > n:
        raise UsageError(
            f"--skip-first {ask.skip_first} leaves no valid position in sequences of {n} tokens "
            f"(positions {ask.skip_first}..{n - 2})",
            hint=f"give a --skip-first of at most {max(0, n - 2)}, or a longer --seq-len",
        )


def sequences(ask: JacobianAsk, the_plan: Plan) -> list[list[int]]:
    """The first fitted sequences, --jacobian-tokens' worth (at least one)."""
    count = max(1, ask.tokens // the_plan.seq_len)
    return [list(ids) for ids in the_plan.fit.ids[:count]]


@dataclass
class JacobianRun:
    """The fit, its artifact (written to `folder`, a temporary one the lens folder is made
    from), and the transport the evaluation reads it through."""

    ask: JacobianAsk
    folder: Path
    model_name: str
    fitted: JacobianFit | None = None
    path: Path | None = None
    seq_len: int = 0

    def fit(self, model: nn.Module, ids: list[list[int]], progress: Progress | None) -> Transport:
        """Fit on `ids`, write the artifact, and open it as the evaluation reads it (float16,
        as written)."""
        from embedlens.analysis.lens.blocks import find_blocks
        from embedlens.analysis.lens.jacobian import Transport, open_jacobian, write_artifact
        from embedlens.analysis.tune.jacobian import fit_jacobian

        a = self.ask
        self.seq_len = len(ids[0])
        self.fitted = fit = fit_jacobian(
            model, ids, skip_first=a.skip_first, estimator=a.estimator, probes=a.probes,
            agree=a.agree, progress=progress,
        )  # fmt: skip
        blocks = len(find_blocks(model).modules)
        ours = {
            "estimator": fit.estimator, "probes": fit.probes, "probe_kind": fit.probe_kind,
            "control_variate": fit.control, "agree": a.agree if fit.probes else None,
            "agreement": _listed(fit.agreement), "backward_passes": fit.backward_passes,
            "forward_passes": fit.forward_passes, "dim_batch": fit.dim_batch,
            "skip_first": fit.skip_first, "seq_len": len(ids[0]), "tokens": len(ids) * len(ids[0]),
        }  # fmt: skip
        metadata = {"target_layer": blocks - 1, "model_name": self.model_name, "embedlens": ours}
        self.path = write_artifact(
            self.folder / FILE, fit.matrices, n_prompts=fit.n_prompts, metadata=metadata
        )
        return Transport(open_jacobian(self.path))

    def report(self, out: Path) -> JacobianFitted:
        """The report's part: the artifact as it will be named in the lens folder."""
        from embedlens.reports.tune import JacobianFitted

        fit = self.fitted
        assert fit is not None
        return JacobianFitted(
            path=str(out / FILE), estimator=fit.estimator, prompts=fit.n_prompts,
            tokens=fit.n_prompts * self.seq_len, skip_first=fit.skip_first,
            backward_passes=fit.backward_passes, forward_passes=fit.forward_passes,
            probes=fit.probes, agreed=fit.agreed, agreement=_listed(fit.agreement),
        )  # fmt: skip


def _listed(agreement: dict[int, float] | None) -> list[float] | None:
    return None if agreement is None else [agreement[k] for k in sorted(agreement)]
