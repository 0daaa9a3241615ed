"""The `tied` report: does the head share the embedding's memory."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from embedlens.reports import Report


@dataclass(frozen=True)
class TiedEvidence:
    """Each piece of evidence on its own; None where it was not available."""

    config: bool | None
    """tie_word_embeddings (or weight_tying) as the config states it."""
    checkpoint_has_lm_head: bool | None
    """Whether the checkpoint stores an output matrix of its own."""
    same_storage: bool | None
    """Built model: the head's weight is the embedding's (identity on meta, data_ptr() loaded)."""


@dataclass(frozen=True)
class TiedReport(Report):
    """Whether the LM head is the embedding matrix, and what that saves."""

    command: ClassVar[str] = "tied"
    model: str
    tied: bool
    shape: list[int]
    saved_params: int
    saved_bytes: int
    dtype: str | None
    evidence: TiedEvidence
    saved_fraction: float
    """saved_params as a share of the model's unique parameters (0 when untied)."""
    embedding_name: str | None
    head_name: str | None
    verdict: str
    """One sentence saying how the evidence was read."""
    consistent: bool
    """False when the pieces of evidence disagree (reported as a note)."""
    notes: list[str] = field(default_factory=list)
