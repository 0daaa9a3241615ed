"""`lens --against --site`: where inside the blocks two models part, attention or MLP.

Each model reads its own sites through its own decoder at the position read (B's while B is
loaded, so B can be freed before A's weights are read); row by row in block order, KL(A ‖ B)
and whether the top-1 agree; the first row past the threshold says which half of which block
the two part in."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from embedlens.analysis.lens.site_report import SITES, SUFFIX, sums, take_apart
from embedlens.analysis.lens.site_rows import Key, decoded_rows
from embedlens.reports.sites import LensSitesPairReport, SiteDiff

if TYPE_CHECKING:
    from embedlens.analysis.lens.blocks import Decoder
    from embedlens.analysis.lens.opening import Opened
    from embedlens.analysis.lens.prompt import Prompt
    from embedlens.analysis.lens.sites import Pieces
    from embedlens.reports.lens_diff import LensPairReport

STREAM = {"attn_out": "attn", "resid_mid": "mid", "mlp_out": "mlp", "resid": "post"}
"""The stream each site's row decodes (resid: the block's output; layer 0: the embedding's)."""


@dataclasses.dataclass(frozen=True)
class SiteLogits:
    """One model's site rows at the position read: (site, layer) -> log-probabilities [V]
    (float64), and its blocks taken apart."""

    logprobs: dict[tuple[str, int], torch.Tensor]
    pieces: Pieces


def site_logits(
    opened: Opened, run: Prompt, sites: Sequence[str], layers: Sequence[int]
) -> SiteLogits:
    """A model's sites at `layers` (>= 1), at the prompt's position read, through its decoder."""
    from embedlens.analysis.lens.blocks import ModelDecoder, find_blocks, input_device

    model = opened.model
    pieces = take_apart(model, run.ids, [run.index], "resid_mid" in sites)
    decoder = ModelDecoder(model, find_blocks(model), dummy_id=run.ids[0])
    vocab = int(model.get_output_embeddings().weight.shape[0])  # type: ignore[operator]
    return logits_at(pieces, decoder, sites, layers, input_device(model), vocab)


def logits_at(
    pieces: Pieces,
    decoder: Decoder,
    sites: Sequence[str],
    layers: Sequence[int],
    device: torch.device,
    vocab: int,
) -> SiteLogits:
    """The sites at `layers` of `pieces` (taken apart at one position: a model's, or a states
    file's) through `decoder`, on `device`."""
    wanted: list[tuple[Key, int]] = [
        ((STREAM[s], layer), 0) for layer in layers for s in SITES if s in sites
    ]
    with torch.inference_mode():
        got = decoded_rows(decoder, pieces, wanted, device, vocab)
        out = {key: row.double().log_softmax(-1).cpu() for (key, _), row in got}
    by_site = {s: STREAM[s] for s in sites}
    return SiteLogits(
        {(s, layer): out[(name, layer)] for s, name in by_site.items() for layer in layers},
        pieces,
    )


def pair_sites(
    report: LensPairReport, a: SiteLogits, b: SiteLogits, sites: Sequence[str]
) -> LensSitesPairReport:
    """A's pair report with the rows inside the blocks compared, and where the two part."""
    threshold = report.diff.threshold
    rows: list[SiteDiff] = []
    for site, layer in sorted(a.logprobs, key=lambda k: (k[1], SITES.index(k[0]))):
        la, lb = a.logprobs[(site, layer)], b.logprobs[(site, layer)]
        kl = float((la.exp() * (la - lb)).sum().clamp(min=0))
        agree = bool(la.argmax() == lb.argmax())
        rows.append(SiteDiff(layer, site, f"{layer}{SUFFIX[site]}", kl, agree))
    first = next((r for r in rows if r.kl > threshold), None)
    base = {f.name: getattr(report, f.name) for f in dataclasses.fields(report)}
    return LensSitesPairReport(
        **base,
        sites=list(sites),
        site_diff=rows,
        parts_at=None if first is None else first.row,
        parts_in=None if first is None else _half(first, sites),
        block_sums=sums(a.pieces),
    )


def _half(row: SiteDiff, sites: Sequence[str]) -> str:
    """Which half of the block the first divergent row blames: a block's output parting where
    its resid_mid (asked for) agreed blames its MLP."""
    if row.site in ("attn_out", "resid_mid"):
        return f"the attention of block {row.layer}"
    if row.site == "mlp_out" or "resid_mid" in sites:
        return f"the MLP of block {row.layer}"
    return f"block {row.layer}"
