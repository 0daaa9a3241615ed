"""`lens --against --site`: where inside the blocks two models part, attention or MLP.

Each model reads its own sites through its own decoder at the positions read (B's while B is
loaded, so B can be freed before A's weights are read); row by row in block order, KL(A ‖ B)
and whether the top-1 agree; the first row past the threshold says which half of which block
the two part in. Over `--prompts`, the same figures of each (prompt, position) are summed
(`SitePairStats`) and their means read the same way."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from embedlens.analysis.lens.site_report import SITES, SUFFIX, sums, take_apart, worse
from embedlens.analysis.lens.sites import Key, decoded_rows
from embedlens.analysis.lens.stats import Sums
from embedlens.reports.lens import BlockSums, SiteDiff, SiteDiffStats

if TYPE_CHECKING:
    from embedlens.analysis.lens.blocks import Decoder
    from embedlens.analysis.lens.opening import Opened, Prompt
    from embedlens.analysis.lens.sites import Pieces
    from embedlens.reports.lens import LensReport, LensSummaryReport

STREAM = {"attn_out": "attn", "resid_mid": "mid", "mlp_out": "mlp", "resid": "post"}
"""The stream each site's row decodes (resid: the block's output; layer 0: the embedding's)."""


@dataclasses.dataclass(frozen=True)
class SiteLogits:
    """One model's site rows at the positions read: (site, layer) -> log-probabilities [P, V]
    (float64, a row per position of `positions`), and its blocks taken apart."""

    logprobs: dict[tuple[str, int], torch.Tensor]
    positions: list[int]
    pieces: Pieces


def site_logits(
    opened: Opened,
    run: Prompt,
    sites: Sequence[str],
    layers: Sequence[int],
    positions: Sequence[int] | None = None,
) -> SiteLogits:
    """A model's sites at `layers` (>= 1), at `positions` (the prompt's position read by
    default), through its decoder."""
    from embedlens.analysis.lens.blocks import ModelDecoder, find_blocks, input_device

    model = opened.model
    at = [run.index] if positions is None else list(positions)
    pieces = take_apart(model, run.ids, at, "resid_mid" in sites)
    decoder = ModelDecoder(model, find_blocks(model), dummy_id=run.ids[0])
    vocab = int(model.get_output_embeddings().weight.shape[0])  # type: ignore[operator]
    return logits_at(pieces, decoder, sites, layers, input_device(model), vocab, at)


def logits_at(
    pieces: Pieces,
    decoder: Decoder,
    sites: Sequence[str],
    layers: Sequence[int],
    device: torch.device,
    vocab: int,
    at: Sequence[int],
) -> SiteLogits:
    """The sites at `layers` of `pieces` (taken apart at the positions `at`: a model's, or a
    states file's) through `decoder`, on `device`."""
    wanted: list[tuple[Key, int]] = [
        ((STREAM[s], layer), j)
        for layer in layers
        for s in SITES
        if s in sites
        for j in range(len(at))
    ]
    with torch.inference_mode():
        got = decoded_rows(decoder, pieces, wanted, device, vocab)
        out = {key: row.double().log_softmax(-1).cpu() for key, row in got}
    rows = {
        (s, layer): torch.stack([out[(STREAM[s], layer), j] for j in range(len(at))])
        for s in sites
        for layer in layers
    }
    return SiteLogits(rows, list(at), pieces)


def _compared(la: torch.Tensor, lb: torch.Tensor) -> tuple[float, bool]:
    """KL(A ‖ B) of two rows of log-probabilities, and whether their top-1 agree."""
    return float((la.exp() * (la - lb)).sum().clamp(min=0)), bool(la.argmax() == lb.argmax())


def _in_block_order(keys: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
    return sorted(keys, key=lambda k: (k[1], SITES.index(k[0])))


def pair_sites(
    report: LensReport, a: SiteLogits, b: SiteLogits, sites: Sequence[str], read: int
) -> LensReport:
    """A's pair report with the rows inside the blocks compared at the position `read`, and
    where the two part."""
    j = a.positions.index(read)
    rows: list[SiteDiff] = []
    for site, layer in _in_block_order(a.logprobs):
        kl, agree = _compared(a.logprobs[(site, layer)][j], b.logprobs[(site, layer)][j])
        rows.append(SiteDiff(layer, site, f"{layer}{SUFFIX[site]}", kl, agree))
    assert report.diff is not None
    parts = _parts(rows, sites, report.diff.threshold)
    return dataclasses.replace(report, **parts, site_diff=rows, block_sums=sums(a.pieces))


def _parts(
    rows: Sequence[SiteDiff | SiteDiffStats], sites: Sequence[str], threshold: float
) -> dict[str, Any]:
    """`sites`, and the first row past the threshold with what it blames."""
    first = next((r for r in rows if r.kl > threshold), None)
    return {
        "sites": list(sites),
        "parts_at": None if first is None else first.row,
        "parts_in": None if first is None else _half(first, sites),
    }


@dataclasses.dataclass
class SitePairStats:
    """Sums per (site, layer) of A against B inside the blocks, over every position read, and
    A's blocks' check over every prompt."""

    sums: dict[tuple[str, int], Sums] = dataclasses.field(default_factory=dict)
    blocks: BlockSums | None = None

    def add(self, a: SiteLogits, b: SiteLogits) -> None:
        """One prompt's rows of A and B (at the same positions) compared."""
        for key, la in a.logprobs.items():
            acc = self.sums.setdefault(key, Sums())
            for j in range(la.shape[0]):
                kl, agree = _compared(la[j], b.logprobs[key][j])
                acc.add("kl", kl)
                acc.add("top1_agreement", int(agree))
        self.blocks = worse(self.blocks, sums(a.pieces))

    def summary(self, summary: LensSummaryReport, sites: Sequence[str]) -> LensSummaryReport:
        """The pair's summary with the means inside the blocks, and where the two part."""
        rows: list[SiteDiffStats] = []
        for site, layer in _in_block_order(self.sums):
            means = self.sums[(site, layer)].values(("kl", "top1_agreement"))
            rows.append(SiteDiffStats(layer, site, f"{layer}{SUFFIX[site]}", **means))
        assert summary.diff is not None
        parts = _parts(rows, sites, summary.diff.threshold)
        return dataclasses.replace(summary, **parts, site_diff=rows, block_sums=self.blocks)


def _half(row: SiteDiff | SiteDiffStats, sites: Sequence[str]) -> str:
    """Which half of the block the first divergent row blames: a block's output parting where
    its resid_mid (asked for) agreed blames its MLP."""
    if row.site in ("attn_out", "resid_mid"):
        return f"the attention of block {row.layer}"
    if row.site == "mlp_out" or "resid_mid" in sites:
        return f"the MLP of block {row.layer}"
    return f"block {row.layer}"
