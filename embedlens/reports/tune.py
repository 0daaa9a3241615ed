"""The `tune` report (a lens fitted, and its held-out evaluation), and the learned lens a lens
report was read through (`lens --tuned`: the report's `tuned`; `lens --jacobian`: `jacobian`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from embedlens.reports import Report, part


@dataclass(frozen=True)
class TuneLayer:
    """One layer of the held-out evaluation: the logit lens against the tuned lens.

    KL(model's output ‖ lens) over every position read, and the cross-entropy of the next token,
    in nats per token; the same in bits per byte of the held-out text (tuned-lens's unit)."""

    layer: int
    logit_kl: float
    tuned_kl: float
    logit_ce: float
    tuned_ce: float
    logit_kl_bpb: float
    tuned_kl_bpb: float
    logit_ce_bpb: float
    tuned_ce_bpb: float
    jacobian_kl: float | None = field(default=None, metadata=part())
    """With --jacobian: the same figures through the Jacobian lens (its matrix, then the model's
    own decoder; the identity at a layer without one)."""
    jacobian_ce: float | None = field(default=None, metadata=part())
    jacobian_kl_bpb: float | None = field(default=None, metadata=part())
    jacobian_ce_bpb: float | None = field(default=None, metadata=part())


@dataclass(frozen=True)
class JacobianFitted:
    """The Jacobian lens `tune --jacobian` fitted beside the tuned lens."""

    path: str
    """The artifact written (OUT/jacobian_lens.pt)."""
    estimator: str
    """'exact' (one-hot cotangents, every output dimension) or 'sketch' (random probes)."""
    prompts: int
    """Sequences fitted (the first of those the tuned lens was fitted on)."""
    tokens: int
    skip_first: int
    backward_passes: int
    forward_passes: int
    probes: int | None
    """The sketch's probes per sequence; null with 'exact'."""
    agreed: bool | None
    """The sketch stopped because its two halves agreed at every layer (else at --probes)."""
    agreement: list[float] | None
    """The sketch: per layer with a matrix (1..L-1), the cosine between its two halves'
    estimates."""


@dataclass(frozen=True)
class TuneReport(Report):
    """A tuned lens fitted and written to `out`, with its held-out evaluation."""

    command: ClassVar[str] = "tune"
    model: str
    out: str
    """The lens folder written (config.json, params.safetensors)."""
    method: str
    """'kl' (least squares, then the KL refinement) or 'affine' (least squares alone)."""
    data: str
    seq_len: int
    fit_tokens: int
    """Tokens the least-squares statistics were taken over."""
    refine_tokens: int
    """Tokens the refinement read (0 with --method affine)."""
    steps: int
    lr: float
    seed: int
    refined_layers: list[int] | None
    """The layers whose refined translator was kept: it lowered the KL on a fitted sequence the
    refinement did not read (the others keep the least-squares one); None with 'affine'."""
    eval: str
    """The held-out text: a file, or the data's tail after the tokens fitted."""
    eval_tokens: int
    eval_bytes: float
    """UTF-8 bytes of text behind the held-out tokens (bits per byte divide by these)."""
    num_layers: int
    hidden_size: int
    dtype: str
    layers: list[TuneLayer]
    """Layers 0..L (the last is the model's own output: KL 0 for both lenses)."""
    notes: list[str] = field(default_factory=list)
    jacobian: JacobianFitted | None = field(default=None, metadata=part())
    """With --jacobian: the Jacobian lens fitted and written beside the tuned lens."""

    @property
    def display_model(self) -> str:
        """The model as titles show it: a local path by its last part, a repo id whole."""
        path = Path(self.model)
        return path.name if path.exists() else self.model


@dataclass(frozen=True)
class TunedLens:
    """The tuned lens a lens report was drawn through."""

    path: str
    made_by: str
    """'embedlens' (`embedlens tune`) or 'tuned-lens' (a lens tuned-lens saved)."""
    base_model: str
    """The model it was tuned on, as its config.json names it."""
    num_layers: int
    """Layers with a translator: 0..num_layers-1 (the model's output has none)."""


@dataclass(frozen=True)
class JacobianArtifact:
    """The Jacobian lens a lens report was drawn through."""

    path: str
    made_by: str
    """'embedlens' (`embedlens tune --jacobian`), 'transformer-lens', or 'jacobian-lens' (the
    reference implementation's artifact)."""
    model_name: str
    """The model it was fitted on, as its metadata names it (empty when it names none)."""
    n_prompts: int
    layers: list[int]
    """The layers with a matrix (the others, the embedding output and the last, the identity)."""
