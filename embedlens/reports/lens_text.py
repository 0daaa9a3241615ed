"""The `lens --text` report: the lens's statistics over every scored token of a text; with
--site, a row per (layer, site) and the parts --site adds (`sites`, `block_sums`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from embedlens.reports import Report, part
from embedlens.reports.lens import BlockSums
from embedlens.text import model_title


@dataclass(frozen=True)
class TextLayer:
    """One layer's statistics over the scored tokens (means; `_err`: llama.cpp's ± uncertainty)."""

    layer: int
    cross_entropy: float
    """Mean -ln p(true next token), nats."""
    cross_entropy_err: float
    bits_per_byte: float
    """The summed cross-entropy in bits over the UTF-8 bytes of the scored tokens."""
    kl: float
    """Mean KL(model's output ‖ lens at this layer), nats."""
    entropy: float
    """Mean entropy of the lens's distribution, nats."""
    top1_accuracy: float
    """The fraction of scored tokens the lens's top-1 is the true next token."""
    next_rank_median: float | None = None
    """The median rank (1 = top, by logit among real tokens) of the true next token."""


@dataclass(frozen=True)
class TextPairLayer:
    """One layer of the reference against the evaluated model: llama-perplexity's KL table."""

    layer: int
    kl: float
    """Mean KL(reference ‖ evaluated), nats (llama.cpp's 'Mean KLD')."""
    kl_err: float
    kl_percentiles: dict[str, float]
    """'max', '99.9', '99', '95', '90', 'median', '10', '5', '1', '0.1', 'min'."""
    same_top: float
    """The fraction of scored tokens where the two argmaxes agree ('Same top p')."""
    same_top_err: float
    dp_mean: float
    """Mean Δp = p_evaluated(true token) - p_reference(true token)."""
    dp_mean_err: float
    dp_rms: float
    dp_rms_err: float
    dp_percentiles: dict[str, float]
    """'max', '99.9', '99', '95', '90', '75', 'median', '25', '10', '5', '1', '0.1', 'min'."""
    cross_entropy_evaluated: float
    """The evaluated model's mean -ln p(true next token) at this layer."""
    ln_ppl_ratio: float
    """Mean ln(PPL(evaluated)/PPL(reference)) at this layer."""
    ln_ppl_ratio_err: float
    residual_kl: float | None
    """Mean KL(reference ‖ reference's decoder on the evaluated model's residual); None when
    the evaluated side is a logits file."""
    against_next_rank_median: float | None = None
    """The evaluated model's `TextLayer.next_rank_median`; None when the reference is a
    logits file."""


@dataclass(frozen=True)
class TextPairOutput:
    """The output layer's perplexities, llama-perplexity's 'Perplexity statistics'."""

    ppl_reference: float
    ppl_reference_err: float
    ppl_evaluated: float
    ppl_evaluated_err: float
    cor: float
    """Cor(ln PPL(evaluated), ln PPL(reference)): the correlation of the per-token NLLs' means."""
    ln_ratio: float
    ln_ratio_err: float
    ratio: float
    ratio_err: float
    diff: float
    diff_err: float


@dataclass(frozen=True)
class TextSiteLayer(TextLayer):
    """One (layer, site) row of `lens --text --site`: a site's statistics over the scored
    tokens, its rows decoded as the residual stream's are (attn_out and mlp_out: the piece
    alone, directly)."""

    site: str = "resid"
    row: str = ""


@dataclass(frozen=True)
class TextSitePairLayer(TextPairLayer):
    """One (layer, site) row of `lens --text --against --site`: llama-perplexity's figures of
    A's site rows against B's (each through its own decoder) over the scored tokens;
    `residual_kl` is given on the residual stream's rows alone."""

    site: str = "resid"
    row: str = ""


@dataclass(frozen=True)
class LensTextReport(Report):
    """The lens over a text (`lens --text`): per layer, over every scored token (with --site:
    per (layer, site))."""

    command: ClassVar[str] = "lens"
    model: str
    text: str
    """The text file read."""
    n_text_tokens: int
    """Tokens of the text used (after --max-tokens)."""
    ctx: int
    stride: int
    score: str
    """'half' (llama-perplexity's rule) or 'all'."""
    n_windows: int
    n_scored: int
    """Scored (position, next token) pairs: the statistics are over these."""
    n_bytes: int
    """UTF-8 bytes of the scored tokens (the bits-per-byte denominator)."""
    num_layers: int
    dtype: str
    perplexity: float
    """exp(mean cross-entropy) of the model's own output."""
    perplexity_err: float
    layers: list[TextLayer] | list[TextSiteLayer]
    """The logit lens (with --tuned: the tuned lens, the logit lens in `logit_layers`)."""
    lens: str = "logit"
    """'logit', 'tuned' or 'jacobian'."""
    logit_layers: list[TextLayer] | None = None
    """With --tuned: the logit lens's statistics on the same tokens."""
    reference: str | None = None
    """With --against or --against-logits: the reference side (llama.cpp's 'base')."""
    evaluated: str | None = None
    """The evaluated side (llama.cpp's 'Q')."""
    pair: list[TextPairLayer] | list[TextSitePairLayer] | None = None
    pair_output: TextPairOutput | None = None
    check_ok: bool = True
    """Decoding the last block's output reproduced the model's logits (first window)."""
    max_abs_logit_diff: float = 0.0
    summary: bool = True
    notes: list[str] = field(default_factory=list)
    sites: list[str] | None = field(default=None, metadata=part())
    """With --site (a site other than resid): the sites asked for; `layers` (and with --against,
    `pair`) then hold a row per (layer, site) in block order."""
    block_sums: BlockSums | None = field(default=None, metadata=part(lambda r: r.sites is not None))

    @property
    def display_model(self) -> str:
        """The model as titles show it."""
        return model_title(self.model)
