"""The `lens --against` reports: one model's lens against another's, layer by layer.

A (MODEL) and B (--against) read the same prompt ids. At each layer: `kl` is KL(P_A ‖ P_B) in
nats, each model's lens through its own decoder (the last layer: the two models' own outputs);
`residual_kl` is KL(P_A ‖ A's decoder applied to B's residual stream), both through A's decoder
at every layer, the last too, so it is 0 wherever the two residual streams are equal whatever
the heads do; `top1_agree` compares the two lenses' top-1 tokens; `target_logprob_delta` is B's
log-probability of the --target token minus A's. `first_divergent_layer` is the first layer
whose `kl` (over many prompts, mean `kl`) exceeds `threshold`, among every layer whether
`layers` holds it or not.
"""

from __future__ import annotations

from dataclasses import dataclass

from embedlens.reports.lens import LensCheck, LensReport, LensSummaryReport, Prediction


@dataclass(frozen=True)
class LensDiffLayer:
    """One layer of A against B at the position read."""

    layer: int
    kl: float
    """KL(P_A ‖ P_B), nats: each model's lens through its own decoder."""
    top1_agree: bool
    residual_kl: float
    """KL(P_A ‖ A's decoder on B's residual), nats: 0 where the residual streams are equal."""
    target_logprob_delta: float | None
    """With a target: B's natural-log probability of it minus A's."""
    against_top: list[Prediction]
    """B's top-k at this layer (A's are the report's `layers`)."""
    against_next_rank: int | None = None
    """B's `next_rank` at this layer."""


@dataclass(frozen=True)
class LensDiff:
    """A's lens against B's at one position."""

    against: str
    """B, as given."""
    threshold: float
    """The KL (nats) above which a layer counts as divergent."""
    first_divergent_layer: int | None
    layers: list[LensDiffLayer]
    against_check: LensCheck
    """B's own self-check: decoding its last block's output reproduces its logits."""


@dataclass(frozen=True, kw_only=True)
class LensPairReport(LensReport):
    """A's lens (every field of `LensReport`) and, in `diff`, where B's parts from it."""

    diff: LensDiff


@dataclass(frozen=True)
class LensDiffLayerStats:
    """One layer of A against B over every prompt and position read (`--prompts`)."""

    layer: int
    kl: float
    """Mean KL(P_A ‖ P_B), nats."""
    residual_kl: float
    """Mean KL(P_A ‖ A's decoder on B's residual), nats."""
    top1_agreement: float
    """The fraction of (prompt, position) where the two lenses' top-1 tokens are equal."""
    target_logprob_delta: float | None
    """Mean of B's log p(target) minus A's, over the rows with a target (null without any)."""
    against_next_rank_median: float | None = None
    """B's `next_rank_median`."""


@dataclass(frozen=True)
class LensSummaryDiff:
    """A against B over many prompts."""

    against: str
    threshold: float
    first_divergent_layer: int | None
    """The first layer whose mean `kl` exceeds `threshold`."""
    layers: list[LensDiffLayerStats]
    n_against_unfaithful: int
    """Prompts on which B's self-check failed (its lens does not reproduce its logits)."""


@dataclass(frozen=True, kw_only=True)
class LensPairSummaryReport(LensSummaryReport):
    """A's summary (every field of `LensSummaryReport`) and, in `diff`, B against it."""

    diff: LensSummaryDiff
