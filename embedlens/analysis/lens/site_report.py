"""`lens --site` on one prompt: the lens's own report, its rows interleaved with the sites inside
each block (`site_rows`), and the check that the blocks' pieces add up (`sites`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from embedlens.errors import UsageError
from embedlens.reports.lens import (
    BlockSums,
    Gained,
    GridCell,
    LensReport,
    Prediction,
    SiteChange,
    SiteGridRow,
    SiteLayer,
    TargetAt,
)

if TYPE_CHECKING:
    from torch import nn

    from embedlens.analysis.lens.blocks import Decoder
    from embedlens.analysis.lens.opening import Opened, Prompt
    from embedlens.analysis.lens.options import Ask
    from embedlens.analysis.lens.report import LensResult
    from embedlens.analysis.lens.sites import Change, Pieces, SiteRows
    from embedlens.analysis.lens.stats import Top

Tok = Callable[[int], str]

SITES: tuple[str, ...] = ("attn_out", "resid_mid", "mlp_out", "resid")
"""The sites, in the order their rows come within a block."""
SUFFIX = {"attn_out": ".attn", "resid_mid": ".mid", "mlp_out": ".mlp", "resid": ""}
"""A site's row label after the layer number: `3.attn`, `3.mid`, `3.mlp`, `3`."""


def sites_asked(value: str | Sequence[str] | None, tuned: object) -> tuple[str, ...]:
    """`--site` (one site or several: comma-separated, or a list) as the sites asked for, in
    block order, checked before any model loads: a tuned lens is fitted to the residual stream
    only."""
    if value is None:
        sites: tuple[str, ...] = ("resid",)
    else:
        items = value.split(",") if isinstance(value, str) else list(value)
        names = [str(s).strip() for s in items if str(s).strip()]
        bad = [s for s in names if s not in SITES]
        if bad or not names:
            raise UsageError(
                f"unknown --site {bad[0] if bad else repr(value)}: use one or more of "
                f"{', '.join(SITES)}, comma-separated",
                hint="e.g. --site resid_mid,resid",
            )
        sites = tuple(s for s in SITES if s in names)
    if tuned is not None and sites != ("resid",):
        raise UsageError(
            "--tuned reads the residual stream only (--site resid): a tuned lens is fitted to "
            "the blocks' outputs, not to the stream inside a block or to what one adds",
            hint="drop --tuned to read the other sites through the model's own decoder",
        )
    return sites


def take_apart(model: nn.Module, ids: Sequence[int], positions: Sequence[int], mid: bool) -> Pieces:
    """The model's blocks taken apart on one prompt (refused where the sums fail, or resid_mid
    of a parallel block when `mid`)."""
    from embedlens.analysis.lens.blocks import find_blocks, threads_for
    from embedlens.analysis.lens.sites import capture_pieces, refuse_mid_in_parallel

    blocks = find_blocks(model)
    with threads_for(model, len(ids)):  # as the engine's pass: the same bytes on any threads
        pieces = capture_pieces(model, blocks, ids, positions)
    if mid:
        refuse_mid_in_parallel(
            pieces.splits, lambda layer: type(blocks.modules[layer - 1]).__name__
        )
    return pieces


def sites_report(
    report: LensReport,
    opened: Opened,
    ask: Ask,
    run: Prompt,
    result: LensResult,
    sites: Sequence[str],
    decoder: Decoder | None = None,
) -> LensReport:
    """The lens's report with the sites' rows; the report itself for `resid` alone."""
    if tuple(sites) == ("resid",):
        return report
    from embedlens.analysis.lens.blocks import ModelDecoder, find_blocks

    model = opened.model
    pieces = take_apart(model, run.ids, result.positions, "resid_mid" in sites)
    if decoder is None:
        decoder = ModelDecoder(model, find_blocks(model), dummy_id=run.ids[0])
    return read_sites(report, sites, pieces, decoder, opened.tokenizer, ask, run, result, model)


def read_sites(
    report: LensReport,
    sites: Sequence[str],
    pieces: Pieces,
    decoder: Decoder,
    tokenizer: Any,
    ask: Ask,
    run: Prompt,
    result: LensResult,
    model: nn.Module,
) -> LensReport:
    """The lens's report with the rows of `sites` decoded from `pieces` (a model's blocks taken
    apart, or a states file's) through `decoder`, on `model`'s device."""
    import torch

    from embedlens.analysis.lens.blocks import input_device, threads_for
    from embedlens.analysis.lens.opening import token_text
    from embedlens.analysis.lens.sites import SiteJob, decode_sites

    inner = [s for s in sites if s != "resid"]
    layers = [layer for layer in result.layers if layer >= 1]
    job = SiteJob(inner, layers, result.positions, run.index, ask.top_k, len(tokenizer),
                  run.target_id, run.ids)  # fmt: skip
    with torch.inference_mode(), threads_for(model, len(run.ids)):
        decoded = decode_sites(job, pieces, decoder, input_device(model), result.vocab_size)
    cache: dict[int, str] = {}

    def tok(i: int) -> str:
        if i not in cache:
            cache[i] = token_text(tokenizer, i)
        return cache[i]

    return joined(report, sites, decoded, pieces, tok)


def joined(
    report: LensReport, sites: Sequence[str], decoded: SiteRows, pieces: Pieces, tok: Tok
) -> LensReport:
    """The lens's report, a row per (layer, site asked) in block order."""
    own = {row.layer: row for row in report.layers}
    rows: list[SiteLayer] = []
    for layer in own:
        for site in (s for s in SITES if s in sites):
            if site == "resid":
                r = {f.name: getattr(own[layer], f.name) for f in dataclasses.fields(own[layer])}
                rows.append(SiteLayer(**r, site=site, row=str(layer)))
            elif layer >= 1:
                rows.append(_row(decoded, site, layer, report.position_index, tok))
    grid = _grid(report, sites, decoded, tok)
    return dataclasses.replace(
        report, layers=rows, grid=grid, sites=list(sites), block_sums=sums(pieces)
    )


def sums(pieces: Pieces) -> BlockSums:
    """The blocks' check as the report gives it."""
    from embedlens.analysis.lens.sites import structure

    return BlockSums(*structure(pieces.splits))


def worse(a: BlockSums | None, b: BlockSums) -> BlockSums:
    """The check over many prompts (or windows): the larger miss (relative to its tolerance)."""
    if a is None or b.max_abs_error / b.tolerance > a.max_abs_error / a.tolerance:
        return b
    return a


def _row(decoded: SiteRows, site: str, layer: int, index: int, tok: Tok) -> SiteLayer:
    top = decoded.rows[(site, layer, index)]
    change = decoded.changes.get((site, layer))
    return SiteLayer(
        layer=layer,
        top=predictions(top, tok),
        target=target_at(top),
        **top.stats,
        site=site,
        row=f"{layer}{SUFFIX[site]}",
        decoded="lens" if site == "resid_mid" else "direct",
        change=None if change is None else site_change(change, tok),
    )


def predictions(top: Top, tok: Tok) -> list[Prediction]:
    """A row's top-k as the report lists them."""
    return [
        Prediction(i, tok(i), p, lp)
        for i, p, lp in zip(top.ids, top.probs, top.logprobs, strict=True)
    ]


def target_at(top: Top) -> TargetAt | None:
    """The target's place in a row, when followed."""
    if top.target_prob is None or top.target_rank is None or top.target_logprob is None:
        return None
    return TargetAt(top.target_prob, top.target_rank, top.target_logprob)


def site_change(change: Change, tok: Tok) -> SiteChange:
    """A piece's change as the report gives it."""
    return SiteChange(change.kl, [Gained(i, tok(i), d, p) for i, d, p in change.gained])


def _grid(
    report: LensReport, sites: Sequence[str], decoded: SiteRows, tok: Tok
) -> list[SiteGridRow] | None:
    """The grid with a row per (layer, site), when the report has one."""
    if report.grid is None:
        return None
    out: list[SiteGridRow] = []
    for g in report.grid:
        for site in (s for s in SITES if s in sites):
            if site == "resid":
                out.append(SiteGridRow(g.layer, g.cells, site, str(g.layer)))
            elif g.layer >= 1:
                cells = [_cell(decoded.rows[(site, g.layer, c.position)], c.position, tok)
                         for c in g.cells]  # fmt: skip
                out.append(SiteGridRow(g.layer, cells, site, f"{g.layer}{SUFFIX[site]}"))
    return out


def _cell(top: Top, position: int, tok: Tok) -> GridCell:
    return GridCell(position, top.ids[0], tok(top.ids[0]), top.probs[0], top.logprobs[0])
