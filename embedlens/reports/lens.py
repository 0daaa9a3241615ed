"""The `lens` reports: what each layer would predict if it were the last, on one prompt
(`LensReport`) or over many (`LensSummaryReport`, the last line of `--prompts`).

Each is one shape whatever the mode: the parts a mode adds (`diff` with --against, `sites` and
`block_sums` with --site, `tuned` with --tuned, `states` with --states, ...) are optional fields,
left out of the JSON when the mode is not asked for (`reports.part`), so that each mode's JSON
is the object docs/json.md gives it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from embedlens.reports import Report, part
from embedlens.reports.tokens import TokenRef
from embedlens.reports.tune import JacobianArtifact, TunedLens
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
    """The logit lens at one position (and optionally the layer x position grid), with the parts
    its mode adds: `diff` (--against), `sites` and `block_sums` (--site; without --against,
    `layers` and `grid` then hold a row per (layer, site); with it, `site_diff`, `parts_at` and
    `parts_in` compare the rows inside the blocks), `tuned` (--tuned) and `states` (--states:
    `check` is null in the JSON when the file holds no logits of the model to check against)."""

    command: ClassVar[str] = "lens"
    model: str
    tokens: list[TokenRef]
    position: int
    """The position `layers` reads, as given (-1 by default)."""
    position_index: int
    """The same position counted from 0."""
    num_layers: int
    layers: list[LensLayer] | list[SiteLayer]
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
    grid: list[GridRow] | list[SiteGridRow] | None = None
    """With --position all (or --plot): the top-1 prediction at every layer and position."""
    placement: dict[str, int] | None = None
    """With --device-map: how many of the model's placed modules went to each device."""
    notes: list[str] = field(default_factory=list)
    diff: LensDiff | None = field(default=None, metadata=part())
    """With --against: where B parts from A (A is the rest of the report)."""
    sites: list[str] | None = field(default=None, metadata=part())
    """With --site (a site other than resid): the sites asked for, in block order."""
    site_diff: list[SiteDiff] | None = field(default=None, metadata=part())
    """With --against and --site: A's rows inside the blocks against B's, in block order."""
    parts_at: str | None = field(default=None, metadata=part(lambda r: r.site_diff is not None))
    """The first row of `site_diff` past the threshold (e.g. '3.mid')."""
    parts_in: str | None = field(default=None, metadata=part(lambda r: r.site_diff is not None))
    """What it blames: 'the attention of block 3', 'the MLP of block 3' or 'block 3'."""
    block_sums: BlockSums | None = field(default=None, metadata=part(lambda r: r.sites is not None))
    tuned: TunedLens | None = field(
        default=None, metadata=part(lambda r: r.tuned is not None or r.states is not None)
    )
    """With --tuned: the tuned lens the layers were read through (with --states: null without)."""
    jacobian: JacobianArtifact | None = field(default=None, metadata=part())
    """With --jacobian: the Jacobian lens the layers were read through."""
    states: StatesSource | None = field(default=None, metadata=part())
    """With --states: where the states came from."""

    def _json_object(self, lists: dict[str, str] | None) -> dict[str, Any]:
        out = super()._json_object(lists)
        if self.states is not None and not self.states.checked:
            out["check"] = None
        return out

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
    layers: list[LensLayerStats] | list[SiteStats]
    summary: bool = True
    notes: list[str] = field(default_factory=list)
    diff: LensSummaryDiff | None = field(default=None, metadata=part())
    """With --against: B against A over every prompt."""
    sites: list[str] | None = field(default=None, metadata=part())
    """With --site: as in `LensReport`; `layers` then holds a row per (layer, site)."""
    site_diff: list[SiteDiffStats] | None = field(default=None, metadata=part())
    parts_at: str | None = field(default=None, metadata=part(lambda r: r.site_diff is not None))
    """As `LensReport` gives them for one prompt, over the means."""
    parts_in: str | None = field(default=None, metadata=part(lambda r: r.site_diff is not None))
    block_sums: BlockSums | None = field(default=None, metadata=part(lambda r: r.sites is not None))
    tuned: TunedLens | None = field(default=None, metadata=part())
    """With --tuned: the tuned lens (`layers` are its statistics)."""
    jacobian: JacobianArtifact | None = field(default=None, metadata=part())
    """With --jacobian: the Jacobian lens (`layers` are its statistics)."""
    logit_layers: list[LensLayerStats] | None = field(
        default=None, metadata=part(lambda r: r.learned and r.diff is None)
    )
    """With --tuned (or --jacobian) --compare-logit: the logit lens's statistics over the same
    prompts (null with --tuned alone; --compare-logit is refused with --against)."""

    @property
    def learned(self) -> bool:
        """Whether the layers were read through a learned lens (tuned or Jacobian)."""
        return self.tuned is not None or self.jacobian is not None

    @property
    def display_model(self) -> str:
        """The model as titles show it (text.model_title): a repo id whole, a local path by its
        last part, never the folder a loaded model's GGUF file sat in."""
        return model_title(self.model)


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
class Parting:
    """Where B (--against) parts from A (MODEL), both reading the same prompt ids."""

    against: str
    """B, as given."""
    threshold: float
    """The KL (nats) above which a layer counts as divergent."""
    first_divergent_layer: int | None
    """The first layer whose `kl` (over many prompts, mean `kl`) exceeds `threshold`, among every
    layer whether `layers` holds it or not."""


@dataclass(frozen=True)
class LensDiff(Parting):
    """A's lens against B's at one position (`lens --against`), layer by layer (`LensDiffLayer`:
    each model's lens through its own decoder, the last layer the two models' own outputs)."""

    layers: list[LensDiffLayer]
    against_check: LensCheck
    """B's own self-check: decoding its last block's output reproduces its logits."""


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
class LensSummaryDiff(Parting):
    """A against B over many prompts."""

    layers: list[LensDiffLayerStats]
    n_against_unfaithful: int
    """Prompts on which B's self-check failed (its lens does not reproduce its logits)."""


@dataclass(frozen=True)
class Gained:
    """A token a piece raised: its log-probability's change (nats) and its probability after."""

    id: int
    token: str
    delta_logprob: float
    prob: float


@dataclass(frozen=True)
class SiteChange:
    """What a piece (attn_out, mlp_out) does to the lens at the position read: KL(lens after the
    piece ‖ lens before it) in nats, and the tokens it raised most."""

    kl: float
    gained: list[Gained]


@dataclass(frozen=True)
class SiteLayer(LensLayer):
    """One row of `lens --site`: `site` is resid, resid_mid, attn_out or mlp_out; `row` its label
    (`3`, `3.mid`, `3.attn`, `3.mlp`); `decoded` says what `top` is: 'lens' (the stream through
    the model's final steps) or 'direct' (the piece alone through them: direct logit
    attribution); a piece's `change` is its effect on the lens."""

    site: str = "resid"
    row: str = ""
    decoded: str = "lens"
    change: SiteChange | None = None


@dataclass(frozen=True)
class SiteGridRow(GridRow):
    """One grid row of `lens --site`: a layer's site across every position."""

    site: str = "resid"
    row: str = ""


@dataclass(frozen=True)
class BlockSums:
    """The check that the pieces add up, on every block and position: sequential blocks
    `resid_pre + attn_out == resid_mid` and `resid_mid + mlp_out == resid_post`, parallel ones
    `resid_pre + attn_out + mlp_out == resid_post`; the largest miss and what rounding allows
    there. `attn` and `mlp`: the modules whose outputs are the pieces (found from the model)."""

    structure: str
    attn: str
    mlp: str
    max_abs_error: float
    tolerance: float


@dataclass(frozen=True)
class SiteStats(LensLayerStats):
    """One (layer, site) row's statistics over many prompts; a piece's `change_kl` is the mean
    KL of the change it makes to the lens (its `kl`, `entropy` and `top1_agreement` are its
    direct decoding's)."""

    site: str = "resid"
    row: str = ""
    change_kl: float | None = None


@dataclass(frozen=True)
class SiteKL:
    """One row inside the blocks, A against B: KL(P_A ‖ P_B) in nats, each model's row through
    its own decoder."""

    layer: int
    site: str
    row: str
    kl: float


@dataclass(frozen=True)
class SiteDiff(SiteKL):
    """One row inside the blocks of `lens --against --site` at the position read, and whether
    the top-1 agree."""

    top1_agree: bool


@dataclass(frozen=True)
class SiteDiffStats(SiteKL):
    """One row inside the blocks of `lens --prompts --against --site`, over every prompt and
    position read: the mean KL and the fraction of rows whose top-1 agree."""

    top1_agreement: float


@dataclass(frozen=True)
class StatesSource:
    """Where the states came from, and what was read to decode them."""

    file: str
    layout: str
    """'embedlens' (`lens --save-states`) or 'vllm' (vLLM's hidden-states connector)."""
    layers: list[int]
    """The layers the file holds (0 = the embedding output, i = block i's output)."""
    dtype: str
    """The states' dtype in the file."""
    checked: bool
    """Whether the decoding of the last layer was compared with the model's own logits."""
    check: str
    """What the self-check did, or why it was not made."""
    tensors_read: list[str] = field(default_factory=list)
    """The checkpoint tensors read to decode (by their names in the checkpoint): the ones that
    run after the last block."""
    metadata: dict[str, str] = field(default_factory=dict)
    """The file's own metadata (embedlens' file: model, revision, dtype, prompt, layers)."""
