"""`lens --against`: A's lens and B's on the same prompt ids, compared layer by layer.

Before any weight is read, B is checked against A (`pairing`: vocabulary, layers, outputs).
One prompt and many run through the same code (`_run`), a window of prompts at a time (one
prompt is a window of one), both models through the same side (`_Side`): B first, keeping at
the rows read its logits at every layer and its residual stream; then A (`_PairRun`), with B's
residual as `other` (its own decoder on B's rows), each prompt compared. The models share
memory as docs/lens.md says: one prompt, B freed before A's weights are read; many, both at once
when the pre-flight says they fit together, else one after the other, B's rows waiting in a
temporary folder a window per file. A model given already loaded is never freed here.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from embedlens.analysis.lens import many
from embedlens.analysis.lens.many import run_one
from embedlens.analysis.lens.opening import (
    Check,
    Opened,
    Prompt,
    check_fits,
    context_length,
    make_prompt,
    open_model,
)
from embedlens.analysis.lens.options import Ask, Load, ManyAsk, resolve_layers
from embedlens.analysis.lens.pairing import (
    LayerDiff,
    Named,
    Pair,
    Side,
    check_pair,
    compare,
    first_above,
    pair_report,
)
from embedlens.analysis.lens.report import one_report
from embedlens.analysis.lens.stats import Sums, add_row
from embedlens.analysis.lens.tuned_folder import fits_tuned
from embedlens.errors import UsageError
from embedlens.model.prompts import PromptLine
from embedlens.reports.lens import LensDiffLayerStats, LensSummaryDiff

if TYPE_CHECKING:
    from embedlens.analysis.lens.engine import BatchOut
    from embedlens.analysis.lens.report import LensResult
    from embedlens.analysis.lens.tuned_folder import Learned
    from embedlens.model.prompts import BadLine, PromptSource
    from embedlens.reports.lens import LensReport, LensSummaryReport

KEEP_BYTES = 256 * 2**20
"""Logits kept for a window of prompts (float32 bytes: B's rows, A's, and A's decoding of B's):
a window holds fewer prompts when their rows would take more."""
PAIR_STATS = tuple(f.name for f in fields(LensDiffLayerStats) if f.name != "layer")
"""The statistics of a pair's `--prompts` summary rows."""

Ran = tuple[list["BatchOut"], list[Any]]
"""A window of one model's: each prompt's rows (at every layer, kept), and its rows inside the
blocks (`site_report.SiteLogits`; None for resid alone)."""


@dataclass(frozen=True)
class _Work:
    """What a pair runs, the same way for one prompt and many: `check` tokenises the prompts
    with A's tokenizer before any weight is read (what it returns is handed to `windows`, after
    A's tokenizer, config and template), `windows` reads them again a window at a time; `opening`:
    A's options for `open_model`; `tuned`: the lens both models are read through (A's; None:
    their own tails); `each`: given each prompt's report."""

    ask: Ask | ManyAsk
    check: Check[Any]
    windows: Callable[..., Iterator[many.Window]]
    opening: dict[str, Any]
    tuned: Learned | None
    each: many.OnReport | None


def lens_pair(pair: Pair, ask: Ask, tuned: Learned | None = None) -> LensReport:
    """One prompt through B then A (B freed first), and A's report with B's `diff` (and where
    inside the blocks the two part, with `ask.sites` other than resid: `site_report`). With `tuned`,
    both sides are read through that lens (tuned on A: checked against A, against B its size
    alone), each then through its own model's tail."""
    check_pair(pair.a, pair.b)
    reports: list[LensReport] = []
    _run(pair, _one(ask, tuned, lambda report, _: reports.append(report)), apart=True)
    return reports[0]


def _one(ask: Ask, tuned: Learned | None, each: many.OnReport | None = None) -> _Work:
    """One prompt as a window of one."""
    line = PromptLine(0, ask.prompt, ask.target, ask.chat)

    def windows(*at: Any, rows: int | None = None) -> Iterator[many.Window]:
        yield [(line, (ask, at[3], None))]  # at: A's tokenizer, config, template, the prompt

    opening = {"target": ask.target, "texts": () if ask.chat is not None else (ask.prompt,)}
    return _Work(ask, functools.partial(make_prompt, ask), windows, opening, tuned, each)


def lens_pair_prompts(
    pair: Pair,
    ask: ManyAsk,
    source: PromptSource,
    each: many.OnReport | None,
    tuned: Learned | None = None,
) -> LensSummaryReport:
    """Many prompts through B and A, both at once when they fit together, else one after the
    other; A's summary with the per-layer means of B against it (with `tuned`, both read
    through that lens, as `lens_pair` reads one prompt; with `ask.sites`, the rows inside the
    blocks compared too, as `lens_pair` compares them on one prompt)."""
    from embedlens.runtime import heap_kept

    check_pair(pair.a, pair.b)
    apart = apart_note(pair.a, pair.b)

    def windows(*at: Any, rows: int | None = None) -> Iterator[many.Window]:
        return many.windows(source, ask, *at[:3], rows=rows)

    # the lines' targets checked from A's files before its tokenizer is built (a GGUF's)
    targets = functools.partial(many.check_targets, source, ask)
    opening = {"targets": targets, "texts": many.plain_texts(source)}
    check = functools.partial(many.check_all, source, ask)
    with heap_kept():
        work = _Work(ask, check, windows, opening, tuned, each)
        run, (n_bad, bad) = _run(pair, work, apart=apart is not None)
        return run.summary(n_bad, bad, [] if apart is None else [apart])


def apart_note(a: Side, b: Side) -> str | None:
    """None when both models fit in memory at once (the pre-flight adds them up); else the note
    saying why they run one after the other."""
    if not isinstance(a.loading, Load) or not isinstance(b.loading, Load):
        return None  # a model given loaded is in memory already
    after = f"'{b.name}' ran first, and was freed before '{a.name}' loaded"
    load = a.loading
    if load.device_map is not None:
        return f"with --device-map each model has the devices to itself: {after}"
    from embedlens.model import preflight
    from embedlens.model.loading import resolve_device
    from embedlens.text import binary_size

    assert a.source is not None and b.source is not None
    est_a, est_b = (preflight.estimate(side, load.dtype) for side in (a.source, b.source))
    device = "cpu" if load.device == "cpu" else resolve_device(load.device)  # cpu: no torch yet
    free, label = preflight.available(device)
    if est_a is None or est_b is None or free is None:
        return f"the memory two models need together cannot be told here: {after}"
    need = est_a.weights + est_b.needed
    if need <= free:
        return None
    return (
        f"the two models together need about {binary_size(need)} of {label}, more than the "
        f"{binary_size(free)} available: {after}"
    )


def _run(pair: Pair, work: _Work, *, apart: bool) -> tuple[_PairRun, Any]:
    """B then A on each window of prompts: both loaded, or with `apart` B on every window
    first, freed before A's weights are read (its rows kept in memory for one prompt, else in a
    temporary folder, a file per window). A's side (its means), and what A's check returned.
    A's check tokenises the prompts with A's tokenizer: B runs on those ids, so they are checked
    against B's GGUF tokenizer too when B is read from a GGUF file (`file_tokens`)."""
    a, b = pair.a, pair.b
    others = () if b.source is None else (b.source,)

    def check(tok: Any, config: Any, template: str) -> Any:
        fits_tuned(work.tuned, config)
        return work.check(tok, config, template)

    def a_side(oa: Opened, checked: Any, named: Named, runs: Iterator[Ran]) -> _PairRun:
        run = _PairRun(oa, named, work, pair.threshold)
        rows = _rows(oa.config, work.ask.sites)
        lines = work.windows(oa.tokenizer, oa.config, oa.template, checked, rows=rows)
        for window, ran_b in zip(lines, runs, strict=True):
            run.window(window, ran_b)
        return run

    def b_first(tok: Any, config: Any, template: str) -> tuple[Any, Named | None]:
        checked = check(tok, config, template)
        if not apart:
            return checked, None
        with _b_side(b, work, (tok, config, template, checked)) as (named, runs):
            for ran in runs:
                path = None if folder is None else Path(folder) / f"{len(kept)}.pt"
                kept.append(ran if path is None else _save(ran, path))
        gc.collect()  # B's weights go before A's are read
        return checked, named

    kept: list[Ran | Path] = []
    ready = open_model(a.model, a.tokenizer, a.loading, b_first, others=others, **work.opening)
    # where B's rows wait while A loads (apart): in memory for one prompt, else a temporary folder
    one = not apart or isinstance(work.ask, Ask)
    keeping = nullcontext() if one else tempfile.TemporaryDirectory(prefix="embedlens-against-")
    with keeping as folder, ready as (oa, ran):
        checked, named = ran
        if named is None:  # B now, beside A
            with _b_side(b, work, (oa.tokenizer, oa.config, oa.template, checked)) as (named, runs):
                return a_side(oa, checked, named, runs), checked
        back = (_load(x) if isinstance(x, Path) else x for x in kept)
        return a_side(oa, checked, named, back), checked


def _save(ran: Ran, path: Path) -> Path:
    import torch

    torch.save(ran, path)
    return path


def _load(path: Path) -> Ran:
    """A window of B's rows read back, its file removed."""
    import torch

    ran: Ran = torch.load(path, weights_only=False)
    path.unlink()
    return ran


@contextmanager
def _b_side(b: Side, work: _Work, at: tuple[Any, ...]) -> Iterator[tuple[Named, Iterator[Ran]]]:
    """B ready on A's ids (`at`: A's tokenizer, config and template, and what A's check
    returned), read with A's tokenizer unless B was given its own; its name and notes, and its
    run of each window. B's check: every prompt fits its context (read again only when it is
    shorter than A's), and a tuned lens its size."""
    tok, config = at[:2]
    lines = functools.partial(work.windows, *at)

    def fits(_tok: Any, b_config: Any, _template: str) -> None:
        fits_tuned(work.tuned, b_config)
        mine, theirs = context_length(b_config), context_length(config)
        if mine is None or (theirs is not None and theirs <= mine):
            return
        try:
            for window in lines():
                for _, (_, prompt, _) in window:
                    check_fits(b_config, prompt.ids, None)
        except UsageError as e:
            raise UsageError(f"'{b.name}': {e.message}", hint=e.hint) from None

    tokenizer = tok if b.tokenizer is None else b.tokenizer
    with open_model(b.model, tokenizer, b.loading, fits) as (ob, _):
        named = Named(ob.name, [f"against: {n}" for n in (*ob.before, *ob.after)])
        yield named, map(_Side(ob, work, own=False).run, lines(rows=_rows(config, work.ask.sites)))


def run_b(
    b: Side, tok: Any, run: Prompt, ask: Ask, tuned: Learned | None
) -> tuple[LensResult, Named, Any]:
    """B on A's ids (`tok`: A's tokenizer), freed before returning: its result at every layer,
    kept for the comparison; its name and notes; its rows inside the blocks (`site_report`)."""
    with _b_side(b, _one(ask, tuned), (tok, None, "", run)) as (named, runs):
        [(outs, inside)] = runs
    gc.collect()  # B's weights go before A's are read
    return outs[0].result, named, inside[0]


def _rows(config: Any, sites: tuple[str, ...]) -> int | None:
    """Rows per window so that the logits kept fit KEEP_BYTES (None: the config cannot say):
    with `sites`, B's rows inside the blocks too (float64, a row per site and layer)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    blocks = getattr(text, "num_hidden_layers", None)
    if not isinstance(vocab, int) or not isinstance(blocks, int) or vocab < 1:
        return None
    layers = blocks + 1  # every layer runs: the first divergent one is found among all
    inside = 0 if sites == ("resid",) else len(sites) * blocks * vocab * 8
    return max(1, KEEP_BYTES // (3 * layers * vocab * 4 + inside))


class _Side:
    """One model's lens on a window of prompts: every layer run and kept for the comparison
    (reports hold the layers asked for, `shown`), and its rows inside the blocks at those; read
    through the tuned lens when there is one (checked against B, `own` False, for its blocks
    alone). Many prompts run in batches (`many.ManyRun`), one prompt through the engine."""

    def __init__(self, opened: Opened, work: _Work, *, own: bool) -> None:
        from embedlens.analysis.lens.blocks import find_blocks
        from embedlens.analysis.lens.decoders import tuned_through

        self.opened, ask = opened, work.ask
        self.sites = ask.sites
        self.through = tuned_through(work.tuned, opened.model, opened.tokenizer, fingerprints=own)
        self.shown = resolve_layers(ask.layers, len(find_blocks(opened.model).modules))
        self.many = None
        if isinstance(ask, ManyAsk):
            self.many = many.ManyRun(opened, ask, None, self.through, keep=True, every=True)

    def run(self, window: many.Window, others: list[Any] | None = None) -> Ran:
        """The window's rows (`others`: the other model's residual for each prompt), and its rows
        inside the blocks at the positions read (one prompt: at its position read)."""
        if self.many is not None:
            outs = self.many.run_window(window, others)
        else:
            outs = [self._alone(ask, prompt, others) for _, (ask, prompt, _) in window]
        if self.sites == ("resid",):
            return outs, [None] * len(outs)
        from embedlens.analysis.lens.site_report import site_logits

        inner = [x for x in self.shown if x >= 1]
        at = [None if self.many is None else out.result.positions for out in outs]
        inside = [
            site_logits(self.opened, prompt, self.sites, inner, positions)
            for (_, (_, prompt, _)), positions in zip(window, at, strict=True)
        ]
        return outs, inside

    def _alone(self, ask: Ask, prompt: Prompt, others: list[Any] | None) -> BatchOut:
        """One prompt through the engine at every layer (`others`: the other model's residual)."""
        from embedlens.analysis.lens.engine import BatchOut

        through, model = self.through, self.opened.model
        decoder = None if through is None else through.decoder(model, prompt.ids[0])
        every = dataclasses.replace(ask, layers=None)  # the first divergent layer, among all
        other = None if others is None else others[0]
        result = run_one(self.opened, every, prompt, keep=True, other=other, decoder=decoder)
        return BatchOut(result, {}, {})

    def report(self, ask: Ask, prompt: Prompt, result: LensResult) -> LensReport:
        """The report the run without B gives of this prompt."""
        report = one_report(self.opened, ask, prompt, many.shown_rows(result, self.shown))
        if self.through is None:
            return report
        return dataclasses.replace(report, **self.through.fields)


class _PairRun(_Side):
    """A's side: each window run with B's residual and compared with B's rows, each prompt's
    report handed on; over many prompts, the sums per layer of A against B (every position
    read) and inside the blocks."""

    def __init__(self, opened: Opened, named: Named, work: _Work, threshold: float) -> None:
        from embedlens.analysis.lens.site_report import SiteSums

        super().__init__(opened, work, own=True)
        self.named, self.each, self.threshold = named, work.each, threshold
        self.sums: dict[int, Sums] = {}
        self.n_against_unfaithful = 0
        self.inside = SiteSums()

    def window(self, window: many.Window, ran_b: Ran) -> None:
        """A's run of a window beside B's, compared prompt by prompt."""
        outs_b, inside_b = ran_b
        residual = [out.result.kept.residual for out in outs_b if out.result.kept is not None]
        outs_a, inside_a = self.run(window, residual)
        tok, named = self.opened.tokenizer, self.named
        for i, (line, (ask, prompt, _)) in enumerate(window):
            a, b = outs_a[i].result, outs_b[i].result
            one = self.many is None
            diffs = compare(a, b, prompt.index) if one else self._add(a, b, prompt.index)
            inside = None if inside_a[i] is None else (inside_a[i], inside_b[i])
            if inside is not None:
                self.inside.add(*inside)
            if self.each is not None:
                report = self.report(ask, prompt, a)
                pair = pair_report(report, diffs, b, named, self.threshold, tok, self.shown, inside)
                self.each(pair, line)

    def _add(self, a: LensResult, b: LensResult, read: int) -> list[LayerDiff]:
        """One prompt's results, compared at every position both read and added to the sums;
        the comparison at the position `read` (its report's)."""
        self.n_against_unfaithful += int(not b.check.ok)
        shown: list[LayerDiff] = []
        for position in a.positions:
            diffs = compare(a, b, position)
            if position == read:
                shown = diffs
            for d in diffs:
                acc = self.sums.setdefault(d.layer, Sums())
                acc.add("kl", d.kl)
                acc.add("residual_kl", d.residual_kl)
                acc.add("top1_agreement", int(d.top1_agree))
                if d.target_logprob_delta is not None:
                    acc.add("target_logprob_delta", d.target_logprob_delta)
                add_row(acc, d.against.stats, "against_")
        return shown

    def summary(self, n_bad: int, bad: list[BadLine], notes: list[str]) -> LensSummaryReport:
        """A's summary with, in `diff`, the per-layer means of B against it (the first divergent
        layer found among all of them, the layers asked for shown); `notes` after B's."""
        assert self.many is not None
        summary = self.many.summary(n_bad, bad)
        rows = sorted(self.sums.items())
        every = [LensDiffLayerStats(layer=x, **acc.values(PAIR_STATS)) for x, acc in rows]
        first = first_above(every, self.threshold)
        layers = [x for x in every if x.layer in self.shown]
        n_unfaithful = self.n_against_unfaithful
        diff = LensSummaryDiff(self.named.name, self.threshold, first, layers, n_unfaithful)
        notes = [*summary.notes, *self.named.notes, *notes]
        pair = dataclasses.replace(summary, notes=notes, diff=diff)
        return pair if self.sites == ("resid",) else self.inside.summary(pair, self.sites)
