"""The parity report (`lens --against-states`, `lens --against-dtype`): two runs of the same
weights (two implementations' saved states, or one model in two precisions) compared layer by
layer over every position, and at the output token by token."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from embedlens.reports import Report, part
from embedlens.text import model_title


@dataclass(frozen=True)
class ParitySide:
    """Where one side's residual streams came from, and how they were decoded."""

    name: str
    """The model run, or the states file (folder) read."""
    source: str
    """'model' (run here) or 'states' (read from a file)."""
    dtype: str
    """The dtype the blocks ran in (a model run), or the states are stored in (a file)."""
    head_dtype: str
    """The dtype of the tail (final norm, head) that decoded its rows."""
    ok: bool | None
    """Whether decoding its last layer at the last position reproduced the model's own logits
    there (None: not checked: its run kept no logits, or holds no last layer)."""
    check: str
    """What the check did, or why it was not made."""
    max_abs_logit_diff: float | None
    tolerance: float | None


@dataclass(frozen=True)
class Worst:
    """A position: where it is and its token."""

    sequence: str
    position: int
    token: str
    value: float
    """The figure that made it the worst (RMS relative difference, or |δ| at the output)."""


@dataclass(frozen=True)
class ParityLayer:
    """One layer over every position compared: how far B's residual stream is from A's."""

    layer: int
    rms_rel_mean: float
    """‖a − b‖ / ‖b‖ of each position's residual vector (A's a, B's b), its mean."""
    rms_rel_median: float
    rms_rel_max: float
    cosine_mean: float
    """cos(a, b) of each position, its mean."""
    cosine_min: float
    kl: float | None
    """Mean KL(A's lens ‖ B's lens) in nats, each side through its own tail; None: a layer not
    decoded (not in --layers)."""
    residual_kl: float | None
    """Mean KL(A's lens ‖ A's tail on B's residual): the difference the residual stream alone
    makes."""
    top1_agree: float | None
    """The fraction of positions where the two lenses' top-1 agree."""
    worst: Worst
    """The position of the largest RMS relative difference."""


@dataclass(frozen=True)
class ParitySiteLayer:
    """A site inside block `layer` (--site) over every position: B's against A's."""

    layer: int
    site: str
    """resid_mid (after attention), attn_out or mlp_out (what each adds)."""
    rms_rel_mean: float
    rms_rel_median: float
    rms_rel_max: float
    cosine_mean: float
    cosine_min: float


@dataclass(frozen=True)
class ParitySequence:
    """One sequence (a prompt, a window of the text, a states file) at the output."""

    name: str
    n_tokens: int
    log_ratio: float
    """Σ δ over its scored tokens: ln of the sequence's importance ratio π_A / π_B."""
    ratio: float
    """exp(log_ratio)."""


@dataclass(frozen=True)
class ParityOutput:
    """The two runs' outputs on the observed next tokens: δ = log π_A(t) − log π_B(t)."""

    n_tokens: int
    delta_mean: float
    delta_rms: float
    delta_p99: float
    """The 99th percentile of |δ| (linear interpolation)."""
    delta_max: float
    """The largest |δ|."""
    top1_flip: float
    """The fraction of scored positions whose top-1 token differs."""
    logits_rms_rel_mean: float
    """‖z_A − z_B‖ / ‖z_B‖ of the output logits of each position, its mean."""
    cap: float
    """The importance-ratio cap (TRL's vllm_importance_sampling_cap, 3.0 by default)."""
    n_over_cap: int
    """Sequences whose ratio exceeds the cap."""
    n_under_cap: int
    """Sequences whose ratio is below 1/cap."""
    sequences: list[ParitySequence]
    worst: list[Worst]
    """The scored tokens with the largest |δ| (five), with the token predicted."""


@dataclass(frozen=True)
class LensParityReport(Report):
    """Two runs of the same weights compared layer by layer (docs/parity.md)."""

    command: ClassVar[str] = "lens"
    model: str
    a: ParitySide
    b: ParitySide
    n_sequences: int
    n_tokens: int
    """Positions compared at every layer (all of each prompt's or file's; --text: the scored)."""
    num_layers: int
    threshold: float
    """The RMS relative difference (mean over positions) above which a layer counts as
    divergent."""
    first_divergent_layer: int | None
    layers: list[ParityLayer]
    output: ParityOutput | None
    """None when a side holds no last layer (a vLLM file without it)."""
    notes: list[str]
    sites: list[ParitySiteLayer] | None = field(default=None, metadata=part())
    """With --site: each site inside each block shown, after `layers`' residual stream."""

    @property
    def display_model(self) -> str:
        return model_title(self.model)
