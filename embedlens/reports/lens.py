"""The `lens` report: what each layer would predict if it were the last."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from embedlens.reports import Report
from embedlens.reports.tokens import TokenRef
from embedlens.text import model_title


@dataclass(frozen=True)
class Prediction:
    """A token and its probability under the model's full softmax (float32: 0 once it
    underflows), with its natural-log probability (never underflows)."""

    id: int
    token: str
    prob: float
    logprob: float


@dataclass(frozen=True)
class TargetAt:
    """The --target token at one layer: its probability, natural-log probability and rank (1 =
    top, by logit) among real tokens."""

    prob: float
    rank: int
    logprob: float


@dataclass(frozen=True)
class LensLayer:
    """One row of the lens: layer 0 is the embedding output, the last the model's own output."""

    layer: int
    top: list[Prediction]
    target: TargetAt | None = None
    next_rank: int | None = None
    """The rank (1 = top, by logit among real tokens) of --target's token, else of the observed
    next token (None after the prompt's last)."""


@dataclass(frozen=True)
class LensTarget:
    """The token followed with --target."""

    text: str
    id: int
    token: str


@dataclass(frozen=True)
class GridCell:
    """The top-1 prediction of one (layer, position)."""

    position: int
    id: int
    token: str
    prob: float
    logprob: float


@dataclass(frozen=True)
class GridRow:
    """One layer across every position."""

    layer: int
    cells: list[GridCell]


@dataclass(frozen=True)
class LensCheck:
    """The lens's decoding of the last block's output against the model's real logits."""

    max_abs_logit_diff: float
    tolerance: float
    ok: bool
    top1_agrees: bool
    suspect: str | None
    """When not ok: the step that failed to reproduce the model."""


@dataclass(frozen=True)
class LensReport(Report):
    """The logit lens at one position (and optionally the layer x position grid)."""

    command: ClassVar[str] = "lens"
    model: str
    tokens: list[TokenRef]
    position: int
    """The position `layers` reads, as given (-1 by default)."""
    position_index: int
    """The same position counted from 0."""
    num_layers: int
    layers: list[LensLayer]
    check: LensCheck
    steps: list[str]
    """What the lens runs after the last block: module names in order, then post-head steps."""
    dtype: str
    vocab_size: int
    """Rows of the model's output (the softmax runs over all of them)."""
    tokenizer_size: int
    """Ids at or past this are padding rows: never shown as predictions."""
    prompt: str
    """The text that was tokenized (with --chat: the template's output followed by PROMPT)."""
    chat: str | None = None
    target: LensTarget | None = None
    grid: list[GridRow] | None = None
    """With --position all (or --plot): the top-1 prediction at every layer and position."""
    placement: dict[str, int] | None = None
    """With --device-map: how many of the model's placed modules went to each device."""
    notes: list[str] = field(default_factory=list)

    @property
    def display_model(self) -> str:
        """The model as titles show it (text.model_title): a repo id whole, a local path by its
        last part, never the folder a loaded model's GGUF file sat in."""
        return model_title(self.model)


@dataclass(frozen=True)
class LensLayerStats:
    """One layer's statistics over every prompt and position read (`--prompts`)."""

    layer: int
    kl: float
    """Mean KL(model's output ‖ lens at this layer), in nats."""
    entropy: float
    """Mean entropy of the lens's distribution, in nats."""
    top1_agreement: float
    """The fraction of (prompt, position) where the lens's top-1 is the model's top-1."""
    target_prob: float | None
    target_logprob: float | None
    target_rank_median: float | None
    """Over the prompts with a target (null without any); ranks by logit, 1 = top."""
    next_rank_median: float | None = None
    """The median `LensLayer.next_rank` over the rows that have one (null without any)."""


@dataclass(frozen=True)
class LensSummaryReport(Report):
    """The lens over many prompts: per-layer statistics (the last line of `--prompts --json`)."""

    command: ClassVar[str] = "lens"
    model: str
    n_prompts: int
    """Prompts run (lines skipped with --skip-bad not counted)."""
    n_positions: int
    """(prompt, position) pairs the statistics are taken over."""
    n_skipped: int
    """Bad lines skipped with --skip-bad."""
    n_targets: int
    """Prompts with a target (the target statistics are over these)."""
    position: int | str | list[int]
    """The positions read in each prompt, as asked (-1, 'all' or a list)."""
    num_layers: int
    dtype: str
    layers: list[LensLayerStats]
    summary: bool = True
    notes: list[str] = field(default_factory=list)

    @property
    def display_model(self) -> str:
        """The model as titles show it (text.model_title): a repo id whole, a local path by its
        last part, never the folder a loaded model's GGUF file sat in."""
        return model_title(self.model)
