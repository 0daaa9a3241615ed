"""`lens --prompts --site`: the lens over many prompts with statistics per (layer, site).

The residual stream's rows are the plain run's (`many.ManyRun`); each prompt is then taken apart
(`sites`, its sums checked) and its other sites decoded a layer at a time, reduced to sums at
once: KL(model's output ‖ the row), the row's entropy, top-1 agreement, the target's place, and a
piece's change KL(lens after it ‖ lens before it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from embedlens.analysis.lens.many import ManyRun
from embedlens.analysis.lens.site_report import (
    SITES,
    SUFFIX,
    sites_report,
    sums,
    take_apart,
    worse,
)
from embedlens.analysis.lens.sites import PIECE, Key, before_after, decoded_rows
from embedlens.analysis.lens.stats import (
    LAYER_STATS,
    ROW_STATS,
    Sums,
    add_row,
    next_ids,
    tops_from_log_softmax,
)
from embedlens.reports.lens import BlockSums, SiteStats

if TYPE_CHECKING:
    from embedlens.analysis.dist import Session
    from embedlens.analysis.lens.blocks import Decoder
    from embedlens.analysis.lens.engine import BatchOut
    from embedlens.analysis.lens.many import Window
    from embedlens.analysis.lens.opening import Prompt
    from embedlens.analysis.lens.options import Ask
    from embedlens.analysis.lens.report import LensResult
    from embedlens.analysis.lens.sites import Pieces
    from embedlens.model.prompts import BadLine
    from embedlens.reports.lens import LensReport, LensSummaryReport


SITE_STATS = (*LAYER_STATS, "change_kl")
"""The statistics of a `--prompts --site` summary's rows (a piece's change too)."""


class SiteManyRun(ManyRun):
    """`ManyRun` with the sites inside the blocks: each prompt's report and the summary with
    their `sites` parts."""

    sites: tuple[str, ...] = ("resid",)

    def with_sites(self, sites: Sequence[str]) -> SiteManyRun:
        """This run, reading `sites`."""
        self.sites = tuple(sites)
        self._sums: dict[tuple[str, int], Sums] = {}
        self._blocks: BlockSums | None = None
        return self

    def run_window(
        self, window: Window, others: list[dict[int, torch.Tensor]] | None = None
    ) -> list[BatchOut]:
        outs = super().run_window(window, others)
        for (_, (_, prompt, _)), out in zip(window, outs, strict=True):
            self._add(prompt, out.result)
        return outs

    def report(self, ask: Ask, prompt: Prompt, out: BatchOut) -> LensReport:
        base = super().report(ask, prompt, out)
        return sites_report(base, self.opened, ask, prompt, out.result, self.sites)

    def summary(self, n_bad: int, bad: list[BadLine]) -> LensSummaryReport:
        base = super().summary(n_bad, bad)
        own = {row.layer: row for row in base.layers}
        rows: list[SiteStats] = []
        for layer, r in own.items():
            for site in (s for s in SITES if s in self.sites):
                if site == "resid":
                    rows.append(SiteStats(**dataclasses.asdict(r), site=site, row=str(layer)))
                elif (site, layer) in self._sums:
                    rows.append(_means(site, layer, self._sums[(site, layer)]))
        sites = list(self.sites)
        return dataclasses.replace(base, layers=rows, sites=sites, block_sums=self._blocks)

    def _merge(self, session: Session, ran: int) -> None:
        """Under torchrun: the sites' sums of every process added (in rank order) too."""
        super()._merge(session, ran)
        merged: dict[tuple[str, int], Sums] = {}
        blocks: BlockSums | None = None
        for theirs, part in session.all_gather((self._sums, self._blocks)):
            for key, acc in theirs.items():
                merged.setdefault(key, Sums()).update(acc)
            blocks = blocks if part is None else worse(blocks, part)
        self._sums, self._blocks = merged, blocks

    def _add(self, prompt: Prompt, result: LensResult) -> None:
        """One prompt's sites: taken apart, decoded a layer at a time, added to the sums."""
        from embedlens.analysis.lens.blocks import (
            ModelDecoder,
            find_blocks,
            input_device,
            threads_for,
        )

        model = self.opened.model
        pieces = take_apart(model, prompt.ids, result.positions, "resid_mid" in self.sites)
        self._blocks = worse(self._blocks, sums(pieces))
        decoder = ModelDecoder(model, find_blocks(model), dummy_id=prompt.ids[0])
        assert result.output is not None
        real = torch.log_softmax(result.output.float(), -1)
        nexts = next_ids(prompt.ids, result.positions)
        job = _Job(pieces, decoder, input_device(model), result.vocab_size, real, nexts)
        with torch.inference_mode(), threads_for(model, len(prompt.ids)):
            for layer in (x for x in result.layers if x >= 1):
                self._layer(job, layer, prompt.target_id)

    def _layer(self, job: _Job, layer: int, target: int | None) -> None:
        """One layer's sites at every position read, added to the sums."""
        inner = [s for s in SITES if s in self.sites and s != "resid"]
        n = int(job.real.shape[0])
        keys: list[Key] = [(PIECE[s], layer) for s in inner]
        for s in inner:
            if s != "resid_mid":
                keys += [k for k in before_after(PIECE[s], layer, job.pieces) if k not in keys]
        wanted = [(key, j) for key in keys for j in range(n)]
        got = dict(decoded_rows(job.decoder, job.pieces, wanted, job.device, job.vocab))
        real_vocab = len(self.opened.tokenizer)
        for s in inner:
            x = torch.stack([got[(PIECE[s], layer), j] for j in range(n)])
            acc = self._sums.setdefault((s, layer), Sums())
            _add_rows(acc, x, job, real_vocab, target)
            if s != "resid_mid":
                before, after = before_after(PIECE[s], layer, job.pieces)
                lb = torch.stack([got[before, j] for j in range(n)]).double().log_softmax(-1)
                la = torch.stack([got[after, j] for j in range(n)]).double().log_softmax(-1)
                change = float((la.exp() * (la - lb)).sum(-1).clamp(min=0).sum())
                acc.add("change_kl", change, n)


@dataclass(frozen=True)
class _Job:
    pieces: Pieces
    decoder: Decoder
    device: torch.device
    vocab: int
    real: torch.Tensor
    """The model's own log-probabilities at the positions read, float32 [P, V]."""
    nexts: list[int | None]
    """The token after each position read."""


def _add_rows(acc: Sums, x: torch.Tensor, job: _Job, real_vocab: int, target: int | None) -> None:
    """One site's rows [P, V] at one layer added to its sums."""
    real = job.real
    lx = torch.log_softmax(x.float(), -1)
    n = int(x.shape[0])
    acc.add("kl", float((real.exp() * (real - lx)).sum(-1).sum()), n)
    acc.add("entropy", float(-(lx.exp() * lx).sum(-1).sum()), n)
    model_top1 = real[:, :real_vocab].argmax(-1)
    acc.add("top1_agreement", int((x[:, :real_vocab].argmax(-1) == model_top1).sum()), n)
    if target is None and not ROW_STATS:
        return
    for top in tops_from_log_softmax(x, lx, 1, real_vocab, [target] * len(x), job.nexts):
        if target is not None:
            acc.add("target_prob", float(top.target_prob or 0.0))
            acc.add("target_logprob", float(top.target_logprob or 0.0))
            acc.rank("target_rank_median", int(top.target_rank or 0))
        add_row(acc, top.stats)


def _means(site: str, layer: int, acc: Sums) -> SiteStats:
    row = f"{layer}{SUFFIX[site]}"
    return SiteStats(layer=layer, **acc.values(SITE_STATS), site=site, row=row)
