"""The `lens --site` report: rows inside the blocks (after attention, what attention and the MLP
each add) interleaved with the residual stream's. With `--site resid` alone the lens's own
report is given, unchanged."""

from __future__ import annotations

from dataclasses import dataclass, field

from embedlens.reports.lens import GridRow, LensLayer, LensLayerStats, LensReport, LensSummaryReport
from embedlens.reports.lens_diff import LensPairReport, LensPairSummaryReport
from embedlens.reports.lens_text import LensTextReport, TextLayer, TextPairLayer


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
class LensSitesReport(LensReport):
    """`lens --site` on one prompt: `layers` and `grid` hold a row per (layer, site)."""

    layers: list[SiteLayer]  # type: ignore[assignment]  # the lens's rows, with their site
    grid: list[SiteGridRow] | None = None  # type: ignore[assignment]
    sites: list[str] = field(default_factory=list)
    block_sums: BlockSums | None = None


@dataclass(frozen=True)
class SiteStats(LensLayerStats):
    """One (layer, site) row's statistics over many prompts; a piece's `change_kl` is the mean
    KL of the change it makes to the lens (its `kl`, `entropy` and `top1_agreement` are its
    direct decoding's)."""

    site: str = "resid"
    row: str = ""
    change_kl: float | None = None


@dataclass(frozen=True)
class LensSitesSummaryReport(LensSummaryReport):
    """`lens --prompts --site`: a row of statistics per (layer, site)."""

    layers: list[SiteStats]  # type: ignore[assignment]  # the summary's rows, with their site
    sites: list[str] = field(default_factory=list)
    block_sums: BlockSums | None = None


@dataclass(frozen=True)
class SiteDiff:
    """One row inside the blocks of `lens --against --site`: KL(P_A ‖ P_B) in nats at the
    position read, each model's row through its own decoder, and whether the top-1 agree."""

    layer: int
    site: str
    row: str
    kl: float
    top1_agree: bool


@dataclass(frozen=True, kw_only=True)
class LensSitesPairReport(LensPairReport):
    """`lens --against --site` on one prompt: the pair report, with `site_diff` row by row in
    block order, the first row past the threshold (`parts_at`, e.g. '3.mid') and what it
    blames (`parts_in`: 'the attention of block 3', 'the MLP of block 3' or 'block 3')."""

    sites: list[str] = field(default_factory=list)
    site_diff: list[SiteDiff] = field(default_factory=list)
    parts_at: str | None = None
    parts_in: str | None = None
    block_sums: BlockSums | None = None


@dataclass(frozen=True)
class SiteDiffStats:
    """One row inside the blocks of `lens --prompts --against --site`, over every prompt and
    position read: the mean KL(P_A ‖ P_B) in nats (each model's row through its own decoder)
    and the fraction of rows whose top-1 agree."""

    layer: int
    site: str
    row: str
    kl: float
    top1_agreement: float


@dataclass(frozen=True, kw_only=True)
class LensSitesPairSummaryReport(LensPairSummaryReport):
    """`lens --prompts --against --site`: the pair's summary, with `site_diff` row by row in
    block order, and the first row whose mean KL passes the threshold (`parts_at`, `parts_in`:
    as `LensSitesPairReport` gives them for one prompt)."""

    sites: list[str] = field(default_factory=list)
    site_diff: list[SiteDiffStats] = field(default_factory=list)
    parts_at: str | None = None
    parts_in: str | None = None
    block_sums: BlockSums | None = None


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
class LensTextSitesReport(LensTextReport):
    """`lens --text --site`: `layers` holds a row per (layer, site) in block order; with
    --against, so does `pair`."""

    layers: list[TextSiteLayer]  # type: ignore[assignment]  # the lens's rows, with their site
    pair: list[TextSitePairLayer] | None = None  # type: ignore[assignment]  # with their site
    sites: list[str] = field(default_factory=list)
    block_sums: BlockSums | None = None
