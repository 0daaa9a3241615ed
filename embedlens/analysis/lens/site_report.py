"""`lens --site` as reports (the sites asked for are checked by `options.sites_asked`): one
prompt's report with a row per (layer, site) (`sites_report`), the `--prompts` summary's
(`SiteManyRun`), and the rows where two models part (`pair_sites`, `SiteSums`); every figure
comes from `sites`, which takes the blocks apart and decodes their pieces."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from embedlens.analysis.lens.many import ManyRun, OnReport
from embedlens.analysis.lens.options import SITES, SUFFIX
from embedlens.analysis.lens.stats import LAYER_STATS, ROW_STATS, Sums, add_row, next_ids
from embedlens.reports.lens import (
    BlockSums,
    Gained,
    GridCell,
    GridRow,
    LensLayer,
    LensReport,
    LensSummaryReport,
    Prediction,
    SiteChange,
    SiteDiff,
    SiteDiffStats,
    SiteGridRow,
    SiteLayer,
    SiteStats,
    TargetAt,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch import nn

    from embedlens.analysis.dist import Session
    from embedlens.analysis.lens.decoders import Through
    from embedlens.analysis.lens.engine import BatchOut
    from embedlens.analysis.lens.many import Window
    from embedlens.analysis.lens.opening import Opened, Prompt
    from embedlens.analysis.lens.options import Ask, ManyAsk
    from embedlens.analysis.lens.report import LensResult
    from embedlens.analysis.lens.sites import Pieces, Reader, SiteRows
    from embedlens.model.prompts import BadLine

SITE_STATS = (*LAYER_STATS, "change_kl")
"""The statistics of a `--prompts --site` summary's rows (a piece's change too)."""


def in_block_order(layers: Iterable[int], sites: Sequence[str]) -> Iterator[tuple[int, str, str]]:
    """(layer, site, its row label) of each layer and each of `sites` in block order (layer 0:
    resid alone, the embedding output having no block)."""
    kept = [s for s in SITES if s in sites]
    return ((x, s, f"{x}{SUFFIX[s]}") for x in layers for s in kept if x or s == "resid")


def model_reader(
    model: nn.Module, run: Prompt, positions: Sequence[int], sites: Sequence[str], vocab: int
) -> Reader:
    """`model`'s blocks taken apart on the prompt at `positions`, read through its own decoder
    into `vocab` rows, on its device."""
    from embedlens.analysis.lens.blocks import ModelDecoder, find_blocks, input_device
    from embedlens.analysis.lens.sites import Reader, take_apart

    pieces = take_apart(model, run.ids, positions, "resid_mid" in sites)
    decoder = ModelDecoder(model, find_blocks(model), dummy_id=run.ids[0])
    return Reader(pieces, decoder, input_device(model), vocab)


def sites_report(
    report: LensReport, opened: Opened, ask: Ask, run: Prompt, result: LensResult
) -> LensReport:
    """The lens's report with the rows of `ask.sites`; the report itself for `resid` alone."""
    if ask.sites == ("resid",):
        return report
    reader = model_reader(opened.model, run, result.positions, ask.sites, result.vocab_size)
    return read_sites(report, reader, opened.tokenizer, ask, run, result, opened.model)


def read_sites(
    report: LensReport,
    reader: Reader,
    tokenizer: Any,
    ask: Ask,
    run: Prompt,
    result: LensResult,
    model: nn.Module,
) -> LensReport:
    """The lens's report with a row per (layer, site asked) in block order, the rows of
    `ask.sites` decoded through `reader` (a model's blocks taken apart, or a states file's,
    on `model`'s threads); the grid too, when the report has one."""
    from embedlens.analysis.lens.sites import decode_sites
    from embedlens.model.tokens import id_text

    sites = ask.sites
    decoded = decode_sites(reader, model, sites, result, run, ask.top_k, len(tokenizer))
    tok = functools.cache(functools.partial(id_text, tokenizer))
    rows = [
        _resid(row, label) if site == "resid" else _row(decoded, site, row.layer, label, tok)
        for row in report.layers
        for _, site, label in in_block_order([row.layer], sites)
    ]
    grid = None
    if report.grid is not None:
        grid = [
            SiteGridRow(g.layer, _cells(decoded, site, g, tok), site, label)
            for g in report.grid
            for _, site, label in in_block_order([g.layer], sites)
        ]
    return dataclasses.replace(
        report, layers=rows, grid=grid, sites=list(sites), block_sums=sums(reader.pieces)
    )


def _resid(row: LensLayer, label: str) -> SiteLayer:
    """The lens's own row, as a site's."""
    fields = {f.name: getattr(row, f.name) for f in dataclasses.fields(row)}
    return SiteLayer(**fields, site="resid", row=label)


def _row(
    decoded: SiteRows, site: str, layer: int, label: str, tok: Callable[[int], str]
) -> SiteLayer:
    """A site's row at the position read: its top-k, the target's place, a piece's change."""
    top = decoded.rows[(site, layer, decoded.index)]
    p, rank, lp = top.target_prob, top.target_rank, top.target_logprob
    at = None if p is None or rank is None or lp is None else TargetAt(p, rank, lp)
    ids = zip(top.ids, top.probs, top.logprobs, strict=True)
    change = decoded.changes.get((site, layer))
    return SiteLayer(
        layer=layer,
        top=[Prediction(i, tok(i), p, lp) for i, p, lp in ids],
        target=at,
        **top.stats,
        site=site,
        row=label,
        decoded="lens" if site == "resid_mid" else "direct",
        change=None
        if change is None
        else SiteChange(change.kl, [Gained(i, tok(i), d, p) for i, d, p in change.gained]),
    )


def _cells(decoded: SiteRows, site: str, row: GridRow, tok: Callable[[int], str]) -> list[GridCell]:
    """A site's grid cells at one layer (the lens's own for resid)."""
    if site == "resid":
        return row.cells
    tops = [(c.position, decoded.rows[(site, row.layer, c.position)]) for c in row.cells]
    return [GridCell(p, t.ids[0], tok(t.ids[0]), t.probs[0], t.logprobs[0]) for p, t in tops]


def sums(pieces: Pieces) -> BlockSums:
    """The blocks' check as the report gives it: their structure ('sequential', 'parallel'), the
    attention's and the MLP's modules (every name found, in order), the largest miss relative to
    its tolerance."""
    splits = pieces.splits.values()
    kinds = dict.fromkeys("parallel" if s.parallel else "sequential" for s in splits)
    attn, mlp = dict.fromkeys(s.attn for s in splits), dict.fromkeys(s.mlp for s in splits)
    worst = max(splits, key=lambda s: s.error / s.tolerance)
    return BlockSums("/".join(kinds), ", ".join(attn), ", ".join(mlp), worst.error, worst.tolerance)


def worse(a: BlockSums | None, b: BlockSums) -> BlockSums:
    """The check over many prompts (or windows): the larger miss (relative to its tolerance)."""
    if a is None or b.max_abs_error / b.tolerance > a.max_abs_error / a.tolerance:
        return b
    return a


@dataclasses.dataclass
class SiteSums:
    """Sums per (site, layer) over every prompt and position read (a prompt's rows; with
    `add`, A's rows against B's), and the blocks' check over every prompt."""

    sums: dict[tuple[str, int], Sums] = dataclasses.field(default_factory=dict)
    blocks: BlockSums | None = None

    def checked(self, pieces: Pieces) -> None:
        """A prompt's blocks' check kept where it misses the most."""
        self.blocks = worse(self.blocks, sums(pieces))

    def update(self, other: SiteSums) -> None:
        """`other`'s sums added into these (another process's)."""
        for key, acc in other.sums.items():
            self.sums.setdefault(key, Sums()).update(acc)
        if other.blocks is not None:
            self.blocks = worse(self.blocks, other.blocks)

    def add(self, a: SiteLogits, b: SiteLogits) -> None:
        """One prompt's rows of A and B (at the same positions) compared."""
        for key, la in a.logprobs.items():
            acc = self.sums.setdefault(key, Sums())
            for j in range(la.shape[0]):
                kl, agree = _compared(a, b, key, j)
                acc.add("kl", kl)
                acc.add("top1_agreement", int(agree))
        self.checked(a.pieces)

    def summary(self, summary: LensSummaryReport, sites: Sequence[str]) -> LensSummaryReport:
        """The pair's summary with the means inside the blocks, and where the two part."""
        rows = [
            SiteDiffStats(
                layer, site, label, **self.sums[(site, layer)].values(("kl", "top1_agreement"))
            )
            for layer, site, label in in_block_order(sorted({x for _, x in self.sums}), sites)
        ]
        return _parted(summary, rows, sites, self.blocks)


@dataclasses.dataclass(frozen=True)
class SiteLogits:
    """One model's rows of `sites` at the positions read: (site, layer) -> log-probabilities
    [P, V] (float64, a row per position of `positions`), and its blocks taken apart."""

    logprobs: dict[tuple[str, int], torch.Tensor]
    positions: list[int]
    pieces: Pieces
    sites: Sequence[str]


def site_logits(
    opened: Opened,
    run: Prompt,
    sites: Sequence[str],
    layers: Sequence[int],
    positions: Sequence[int] | None = None,
) -> SiteLogits:
    """A model's sites at `layers` (>= 1), at `positions` (the prompt's position read by
    default), through its decoder."""
    model = opened.model
    at = [run.index] if positions is None else list(positions)
    vocab = int(model.get_output_embeddings().weight.shape[0])  # type: ignore[operator]
    return logits_at(model_reader(model, run, at, sites, vocab), sites, layers, at)


def logits_at(
    reader: Reader, sites: Sequence[str], layers: Sequence[int], at: Sequence[int]
) -> SiteLogits:
    """The sites at `layers` of `reader`'s pieces (taken apart at the positions `at`: a
    model's, or a states file's)."""
    import torch

    from embedlens.analysis.lens.sites import PIECE, stacked

    with torch.inference_mode():
        got = reader.decoded(reader.rows([s for s in SITES if s in sites], layers, len(at), ()))
        out = {key: row.double().log_softmax(-1).cpu() for key, row in got}
    logprobs = {
        (s, layer): stacked(out, (PIECE[s], layer), range(len(at)))
        for s in sites
        for layer in layers
    }
    return SiteLogits(logprobs, list(at), reader.pieces, sites)


def _compared(a: SiteLogits, b: SiteLogits, key: tuple[str, int], j: int) -> tuple[float, bool]:
    """KL(A ‖ B) of A's and B's rows of `key` at their j-th position, and whether their top-1
    agree."""
    from embedlens.analysis.lens.sites import kl

    la, lb = a.logprobs[key][j], b.logprobs[key][j]
    return float(kl(la, lb)), bool(la.argmax() == lb.argmax())


def pair_sites(report: LensReport, a: SiteLogits, b: SiteLogits, read: int) -> LensReport:
    """A's pair report with the rows inside the blocks compared at the position `read`, and
    where the two part."""
    j, layers = a.positions.index(read), sorted({x for _, x in a.logprobs})
    rows = [
        SiteDiff(layer, site, label, *_compared(a, b, (site, layer), j))
        for layer, site, label in in_block_order(layers, a.sites)
    ]
    return _parted(report, rows, a.sites, sums(a.pieces))


R = TypeVar("R", LensReport, LensSummaryReport)


def _parted(report: R, rows: list[Any], sites: Sequence[str], blocks: BlockSums | None) -> R:
    """`report` with `sites`, its `rows` inside the blocks compared (`site_diff`: a report's
    `SiteDiff`, a summary's `SiteDiffStats`), the blocks' check, and the first row past the
    threshold with what it blames: a block's output parting where its resid_mid (asked for)
    agreed blames its MLP."""
    assert report.diff is not None
    first = next((r for r in rows if r.kl > report.diff.threshold), None)
    at = blamed = None
    if first is not None:
        at, blamed = first.row, f"block {first.layer}"
        if first.site in ("attn_out", "resid_mid"):
            blamed = f"the attention of block {first.layer}"
        elif first.site == "mlp_out" or "resid_mid" in sites:
            blamed = f"the MLP of block {first.layer}"
    return dataclasses.replace(
        report, sites=list(sites), parts_at=at, parts_in=blamed, site_diff=rows, block_sums=blocks
    )


class SiteManyRun(ManyRun):
    """`ManyRun` with the sites inside the blocks: each prompt's report and the summary with
    their `sites` parts (a piece's statistics summed in `inside` as each prompt runs)."""

    def __init__(
        self, opened: Opened, ask: ManyAsk, each: OnReport | None, through: Through | None
    ) -> None:
        super().__init__(opened, ask, each, through)
        self.sites, self.inside = ask.sites, SiteSums()

    def run_window(
        self, window: Window, others: list[dict[int, Any]] | None = None
    ) -> list[BatchOut]:
        outs = super().run_window(window, others)
        for (_, (_, prompt, _)), out in zip(window, outs, strict=True):
            self._add(prompt, out.result)
        return outs

    def _add(self, run: Prompt, result: LensResult) -> None:
        """One prompt's sites other than resid, taken apart (their check kept) and decoded a
        layer at a time, added to the sums at once: KL(model's output ‖ the row), the row's
        entropy, top-1 agreement, the target's place, `ROW_STATS`, a piece's change KL."""
        import torch

        from embedlens.analysis.lens.blocks import threads_for
        from embedlens.analysis.lens.sites import kl

        model, inner = self.opened.model, [s for s in self.sites if s != "resid"]
        reader = model_reader(model, run, result.positions, self.sites, result.vocab_size)
        self.inside.checked(reader.pieces)
        assert result.output is not None
        real = torch.log_softmax(result.output.float(), -1)
        nexts, n = next_ids(run.ids, result.positions), int(real.shape[0])
        with torch.inference_mode(), threads_for(model, len(run.ids)):
            for layer in (x for x in result.layers if x >= 1):
                for site, _, x, moved in reader.sites(inner, [layer], n, range(n)):
                    acc = self.inside.sums.setdefault((site, layer), Sums())
                    _add_rows(acc, x, real, nexts, len(self.opened.tokenizer), run.target_id)
                    if moved:
                        lb, la = (rows.double().log_softmax(-1) for rows in moved)
                        acc.add("change_kl", float(kl(la, lb).sum()), n)

    def report(self, ask: Ask, prompt: Prompt, out: BatchOut) -> LensReport:
        base = super().report(ask, prompt, out)
        return sites_report(base, self.opened, ask, prompt, out.result)

    def summary(self, n_bad: int, bad: list[BadLine]) -> LensSummaryReport:
        base = super().summary(n_bad, bad)
        own = {row.layer: row for row in base.layers}
        rows: list[SiteStats] = []
        for layer, site, label in in_block_order(own, self.sites):
            if site == "resid":
                rows.append(SiteStats(**dataclasses.asdict(own[layer]), site=site, row=label))
            elif (site, layer) in self.inside.sums:
                means = self.inside.sums[(site, layer)].values(SITE_STATS)
                rows.append(SiteStats(layer=layer, **means, site=site, row=label))
        blocks = self.inside.blocks
        return dataclasses.replace(base, layers=rows, sites=list(self.sites), block_sums=blocks)

    def _merge(self, session: Session, ran: int) -> None:
        """Under torchrun: the sites' sums of every process added (in rank order) too."""
        super()._merge(session, ran)
        merged = SiteSums()
        for part in session.all_gather(self.inside):
            merged.update(part)
        self.inside = merged


def _add_rows(
    acc: Sums,
    x: torch.Tensor,
    real: torch.Tensor,
    nexts: list[int | None],
    real_vocab: int,
    target: int | None,
) -> None:
    """One site's rows [P, V] at one layer added to its sums (`real`: the model's own
    log-probabilities at the positions read, float32 [P, V])."""
    from embedlens.analysis.lens.stats import tops_from_log_softmax

    lx = x.float().log_softmax(-1)
    n = int(x.shape[0])
    acc.add("kl", float((real.exp() * (real - lx)).sum(-1).sum()), n)
    acc.add("entropy", float(-(lx.exp() * lx).sum(-1).sum()), n)
    model_top1 = real[:, :real_vocab].argmax(-1)
    acc.add("top1_agreement", int((x[:, :real_vocab].argmax(-1) == model_top1).sum()), n)
    if target is None and not ROW_STATS:
        return
    for top in tops_from_log_softmax(x, lx, 1, real_vocab, [target] * len(x), nexts):
        if target is not None:
            acc.add("target_prob", float(top.target_prob or 0.0))
            acc.add("target_logprob", float(top.target_logprob or 0.0))
            acc.rank("target_rank_median", int(top.target_rank or 0))
        add_row(acc, top.stats)
