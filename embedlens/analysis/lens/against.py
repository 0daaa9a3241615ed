"""`lens --against`: A's lens and B's on the same prompt ids, compared layer by layer.

Before any weight is read, B is checked against A (`pairing`: vocabulary, layers, outputs).
B always runs first, keeping at the rows read its logits at every layer and its residual
stream; A then runs with B's residual as `other` (its own decoder on B's rows), and `pair`
compares the two. How the models share memory:

- one prompt: B is loaded, run and freed before A's weights are read (what A needs of it is a
  few rows), so the two are never in memory together;
- many prompts: both at once when the pre-flight says they fit together (A's weights plus B's
  load), B and A then taking each window of prompts in turn; otherwise one after the other: B
  runs every prompt, its rows wait in a temporary folder a window per file, and B is freed
  before A loads and reads them back.

A model given already loaded is in memory whatever is done, and is never freed here.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from embedlens.analysis.lens import many
from embedlens.analysis.lens.opening import Check, Opened, Targets, open_model
from embedlens.analysis.lens.options import Ask, Load, ManyAsk, resolve_layers
from embedlens.analysis.lens.pairing import Pair, Side, check_pair
from embedlens.analysis.lens.prompt import Prompt, check_fits, context_length, make_prompt
from embedlens.analysis.lens.report import one_report, run_one
from embedlens.analysis.lens.tuned_folder import fits_tuned
from embedlens.errors import UsageError

if TYPE_CHECKING:
    from embedlens.analysis.lens.batch import BatchOut
    from embedlens.analysis.lens.engine import LensResult
    from embedlens.analysis.lens.pair import PairStats
    from embedlens.analysis.lens.tuned_folder import LensFolder
    from embedlens.model.prompts import BadLine, PromptSource
    from embedlens.reports.lens import LensReport, LensSummaryReport

T = TypeVar("T")

KEEP_BYTES = 256 * 2**20
"""Logits kept for a window of prompts (float32 bytes: B's rows, A's, and A's decoding of B's):
a window holds fewer prompts when their rows would take more."""


@dataclass(frozen=True)
class Named:
    """What the reports say of B, kept after it is freed: its name and its notes."""

    name: str
    notes: list[str]


def lens_pair(
    pair: Pair, ask: Ask, sites: Sequence[str] = ("resid",), tuned: LensFolder | None = None
) -> LensReport:
    """One prompt through B then A (B freed first), and A's report with B's `diff` (and where
    inside the blocks the two part, with `sites` other than resid: `site_report`). With `tuned`,
    both sides are read through that lens (tuned on A: checked against A, against B its size
    alone), each then through its own model's tail."""
    a, b = pair.a, pair.b
    check_pair(a, b)
    every = dataclasses.replace(ask, layers=None)  # the first divergent layer, among all

    def b_first(tok: Any, config: Any, template: str) -> tuple[Prompt, LensResult, Named, Any]:
        fits_tuned(tuned, config)
        run = make_prompt(ask, tok, config, template)
        return (run, *run_b(b, tok, run, ask, sites, tuned))

    texts = () if ask.chat is not None else (ask.prompt,)
    with _ready_a(a, b, b_first, target=ask.target, texts=texts) as (oa, ran):
        run, rb, named, b_sites = ran
        assert rb.kept is not None
        from embedlens.analysis.lens.decoders import tuned_decoder

        decoder, described = tuned_decoder(tuned, oa, run)
        ra_every = run_one(oa, every, run, keep=True, other=rb.kept.residual, decoder=decoder)
        ra = _shown(ra_every, ask)
        report = one_report(oa, ask, run, ra)
        if described is not None:
            report = dataclasses.replace(report, tuned=described)
        a_sites = functools.partial(_site_logits, oa, run, sites, ra.layers)
        b_ran = (rb, named, b_sites)
        return paired(report, ra_every, b_ran, pair.threshold, oa.tokenizer, run.index, ra.layers,
                      (a_sites, sites))  # fmt: skip


def paired(
    report: LensReport,
    a: LensResult,
    b: tuple[LensResult, Named, Any],
    threshold: float,
    tokenizer: Any,
    index: int,
    shown: list[int],
    a_sites: tuple[Callable[[], Any], Sequence[str]],
) -> LensReport:
    """A's report with B's `diff` at the position read (`a`: A's result at every layer, kept
    beside B's residual; `b`: what `run_b` gives); with sites inside the blocks, where the two
    part there (`a_sites`: what reads A's rows there, once B's are read, and the sites)."""
    from embedlens.analysis.lens.pair import compare, pair_report

    rb, named, b_sites = b
    diffs = compare(a, rb, index)
    report = pair_report(report, diffs, rb, named.name, threshold, tokenizer, named.notes, shown)
    if b_sites is None:
        return report
    from embedlens.analysis.lens.site_report import pair_sites

    return pair_sites(report, a_sites[0](), b_sites, a_sites[1], index)


def run_b(
    b: Side, tok: Any, run: Prompt, ask: Ask, sites: Sequence[str], tuned: LensFolder | None
) -> tuple[LensResult, Named, Any]:
    """B on A's ids (`tok`: A's tokenizer), freed before returning: its result at every layer,
    kept for the comparison; its name and notes; its rows inside the blocks (`_site_logits`)."""
    every = dataclasses.replace(ask, layers=None)
    with _ready_b(b, tok, _fits_b(b, ask, lambda: [run.ids], tuned=tuned)) as ob:
        from embedlens.analysis.lens.decoders import tuned_decoder

        decoder, _ = tuned_decoder(tuned, ob, run, fingerprints=False)
        result = run_one(ob, every, run, keep=True, decoder=decoder)
        named = _named(ob)
        b_sites = _site_logits(ob, run, sites, _shown(result, ask).layers)
    gc.collect()  # B's weights go before A's are read
    return result, named, b_sites


def _shown(result: LensResult, ask: Ask) -> LensResult:
    """A result at every layer cut to the layers `ask` shows (what its report and table hold)."""
    return cut(result, resolve_layers(ask.layers, result.num_layers))


def cut(result: LensResult, shown: Sequence[int]) -> LensResult:
    """A result cut to the layers `shown`."""
    rows = {key: top for key, top in result.rows.items() if key[0] in shown}
    return dataclasses.replace(result, layers=sorted(set(shown)), rows=rows)


def _site_logits(
    opened: Opened,
    run: Prompt,
    sites: Sequence[str],
    layers: Sequence[int],
    positions: Sequence[int] | None = None,
) -> Any:
    """A model's rows inside the blocks at `layers` (`site_report.site_logits`: at `positions`,
    by default the prompt's position read); None for resid alone."""
    if tuple(sites) == ("resid",):
        return None
    from embedlens.analysis.lens.site_report import site_logits

    return site_logits(opened, run, sites, [x for x in layers if x >= 1], positions)


def lens_pair_prompts(
    pair: Pair,
    ask: ManyAsk,
    source: PromptSource,
    each: many.OnReport | None,
    tuned: LensFolder | None = None,
    sites: Sequence[str] = ("resid",),
) -> LensSummaryReport:
    """Many prompts through B and A, both at once when they fit together, else one after the
    other; A's summary with the per-layer means of B against it (with `tuned`, both read
    through that lens, as `lens_pair` reads one prompt; with `sites`, the rows inside the
    blocks compared too, as `lens_pair` compares them on one prompt)."""
    from embedlens.runtime import heap_kept

    a, b = pair.a, pair.b
    check_pair(a, b)
    apart = apart_note(a, b)
    start = _PairRun.factory(ask, each, pair.threshold, tuned, sites)
    with heap_kept():
        if apart is None:
            return _together(a, b, ask, source, start, (tuned, sites))
        return _apart(a, b, ask, source, start, apart, (tuned, sites))


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
    est_a, est_b = (
        preflight.estimate(a.source, load.dtype),
        preflight.estimate(b.source, load.dtype),
    )
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


def _together(
    a: Side,
    b: Side,
    ask: ManyAsk,
    source: PromptSource,
    pair: Callable[[Opened, Named], _PairRun],
    reading: tuple[LensFolder | None, Sequence[str]],
) -> LensSummaryReport:
    """Both models loaded; B then A on each window of prompts (`reading`: the tuned lens and
    the sites)."""
    tuned, sites = reading

    def check(tok: Any, config: Any, template: str) -> tuple[int, list[BadLine]]:
        fits_tuned(tuned, config)
        return many.check_all(source, ask, tok, config, template)

    targets = _targets(source, ask)
    texts = many.plain_texts(source)
    with _ready_a(a, b, check, targets=targets, texts=texts) as (oa, (n_bad, bad)):
        lines = functools.partial(many.windows, source, ask, oa.tokenizer, oa.config, oa.template)
        with _ready_b(b, oa.tokenizer, _fits_b(b, ask, _ids(lines), oa.config, tuned)) as ob:
            run_b = _run_b(ob, ask, reading)
            run = pair(oa, _named(ob))
            for window in lines(rows=_rows(oa.config, ask, sites)):
                run.window(window, run_b(window))
            return run.summary(n_bad, bad, [])


def _apart(
    a: Side,
    b: Side,
    ask: ManyAsk,
    source: PromptSource,
    pair: Callable[[Opened, Named], _PairRun],
    note: str,
    reading: tuple[LensFolder | None, Sequence[str]],
) -> LensSummaryReport:
    """B on every prompt, its rows kept in a temporary folder, B freed; then A."""
    tuned, sites = reading
    with tempfile.TemporaryDirectory(prefix="embedlens-against-") as tmp:
        folder = Path(tmp)

        def b_first(tok: Any, config: Any, template: str) -> tuple[int, list[BadLine], Named]:
            fits_tuned(tuned, config)
            n_bad, bad = many.check_all(source, ask, tok, config, template)
            lines = functools.partial(many.windows, source, ask, tok, config, template)
            with _ready_b(b, tok, _fits_b(b, ask, _ids(lines), config, tuned)) as ob:
                run_b = _run_b(ob, ask, reading)
                for i, window in enumerate(lines(rows=_rows(config, ask, sites))):
                    _save(run_b(window), folder / f"{i}.pt")
                named = _named(ob)
            gc.collect()  # B's weights go before A's are read
            return n_bad, bad, named

        targets = _targets(source, ask)
        texts = many.plain_texts(source)
        with _ready_a(a, b, b_first, targets=targets, texts=texts) as (oa, ran):
            n_bad, bad, named = ran
            run = pair(oa, named)
            rows = _rows(oa.config, ask, sites)
            lines = many.windows(source, ask, oa.tokenizer, oa.config, oa.template, rows=rows)
            for i, window in enumerate(lines):
                run.window(window, _load(folder / f"{i}.pt"))
            return run.summary(n_bad, bad, [note])


Ran = tuple[list["BatchOut"], list[Any]]
"""A window of B's: each prompt's rows (at every layer, kept), and its rows inside the blocks
(`site_report.SiteLogits`; None for resid alone)."""


def _run_b(
    opened: Opened, ask: ManyAsk, reading: tuple[LensFolder | None, Sequence[str]]
) -> Callable[[many.Window], Ran]:
    """B's run of a window (`reading`: the tuned lens, A's, and the sites)."""
    tuned, sites = reading
    from embedlens.analysis.lens.decoders import through_of

    through = through_of(tuned, opened, fingerprints=False)
    run = many.ManyRun(opened, ask, None, through, keep=True, every=True)

    def window(lines: many.Window) -> Ran:
        outs = run.run_window(lines)
        inside = [
            _site_logits(opened, prompt, sites, run.shown, out.result.positions)
            for (_, (_, prompt, _)), out in zip(lines, outs, strict=True)
        ]
        return outs, inside

    return window


def _save(ran: Ran, path: Path) -> None:
    import torch

    torch.save(ran, path)


def _load(path: Path) -> Ran:
    """A window of B's rows read back, its file removed."""
    import torch

    ran: Ran = torch.load(path, weights_only=False)
    path.unlink()
    return ran


class _PairRun:
    """A's side of many prompts: each window run with B's residual, compared with B's rows."""

    def __init__(
        self,
        opened: Opened,
        named: Named,
        ask: ManyAsk,
        each: many.OnReport | None,
        threshold: float,
        tuned: LensFolder | None = None,
        sites: Sequence[str] = ("resid",),
    ) -> None:
        from embedlens.analysis.lens.pair import PairStats
        from embedlens.analysis.lens.site_report import SiteSums

        self.opened, self.named, self.each, self.threshold = opened, named, each, threshold
        from embedlens.analysis.lens.decoders import through_of

        through = through_of(tuned, opened)
        self.run = many.ManyRun(opened, ask, None, through, keep=True, every=True)
        self.stats: PairStats = PairStats()
        self.sites, self.inside = tuple(sites), SiteSums()

    @staticmethod
    def factory(
        ask: ManyAsk,
        each: many.OnReport | None,
        threshold: float,
        tuned: LensFolder | None,
        sites: Sequence[str],
    ) -> Callable[[Opened, Named], _PairRun]:
        """How to start A's side once A is ready and B has been (`named`)."""
        return lambda opened, named: _PairRun(opened, named, ask, each, threshold, tuned, sites)

    def window(self, window: many.Window, ran_b: Ran) -> None:
        from embedlens.analysis.lens.pair import pair_report

        outs_b, inside_b = ran_b
        others = [_residual(out.result) for out in outs_b]
        outs_a = self.run.run_window(window, others)
        for i, ((line, (ask, prompt, _)), out_a) in enumerate(zip(window, outs_a, strict=True)):
            out_b = outs_b[i]
            diffs = self.stats.add(out_a.result, out_b.result, prompt.index)
            shown, at = self.run.shown, out_a.result.positions
            inside = _site_logits(self.opened, prompt, self.sites, shown, at)
            if inside is not None:
                self.inside.add(inside, inside_b[i])
            if self.each is not None:
                report = self.run.report(ask, prompt, out_a)
                named, tok = self.named, self.opened.tokenizer
                pair = pair_report(report, diffs, out_b.result, named.name, self.threshold, tok,
                                   named.notes, self.run.shown)  # fmt: skip
                if inside is not None:
                    from embedlens.analysis.lens.site_report import pair_sites

                    pair = pair_sites(pair, inside, inside_b[i], self.sites, prompt.index)
                self.each(pair, line)

    def summary(self, n_bad: int, bad: list[BadLine], notes: list[str]) -> LensSummaryReport:
        """A's summary with the means of B against it; `notes` after B's."""
        from embedlens.analysis.lens.pair import pair_summary

        summary = self.run.summary(n_bad, bad)
        named = self.named
        notes = [*named.notes, *notes]
        pair = pair_summary(summary, self.stats, named.name, self.threshold, notes, self.run.shown)
        return pair if self.sites == ("resid",) else self.inside.summary(pair, self.sites)


def _targets(source: PromptSource, ask: ManyAsk) -> Targets:
    """The lines' targets checked from A's files before its tokenizer is built (a GGUF's: the
    check `lens --prompts` makes); B reads A's ids, tokenized by A's tokenizer alone."""
    return functools.partial(many.check_targets, source, ask)


def _ready_a(
    a: Side, b: Side, check: Check[T], **asked: Any
) -> AbstractContextManager[tuple[Opened, T]]:
    """A ready (`opening.open_model`, `asked` its options) after `check`, which tokenises the prompts
    with A's tokenizer: B runs on those ids, so they are checked against B's GGUF tokenizer
    too when B is read from a GGUF file (`file_tokens`)."""
    others = () if b.source is None else (b.source,)
    return open_model(a.model, a.tokenizer, a.loading, check, others=others, **asked)


def _residual(result: LensResult) -> dict[int, Any]:
    assert result.kept is not None
    return result.kept.residual


@contextmanager
def _ready_b(b: Side, a_tokenizer: Any, check: Check[None]) -> Iterator[Opened]:
    """B ready, reading A's prompt ids with A's tokenizer (the vocabularies are the same) unless
    it was given its own."""
    tokenizer = a_tokenizer if b.tokenizer is None else b.tokenizer
    with open_model(b.model, tokenizer, b.loading, check) as (opened, _):
        yield opened


def _named(opened: Opened) -> Named:
    return Named(opened.name, [f"against: {n}" for n in (*opened.before, *opened.after)])


def _fits_b(
    b: Side,
    ask: Ask | ManyAsk,
    ids: Callable[[], Any],
    a_config: Any = None,
    tuned: LensFolder | None = None,
) -> Check[None]:
    """B's check: every prompt fits its context (read again only when it is shorter than A's),
    and a tuned lens its size."""

    def check(_tok: Any, config: Any, _template: str) -> None:
        fits_tuned(tuned, config)
        mine, theirs = context_length(config), context_length(a_config)
        if mine is None or (a_config is not None and theirs is not None and theirs <= mine):
            return
        try:
            for row in ids():
                check_fits(config, row, None)
        except UsageError as e:
            raise UsageError(f"'{b.name}': {e.message}", hint=e.hint) from None

    return check


def _ids(lines: Callable[..., Iterator[many.Window]]) -> Callable[[], Iterator[list[int]]]:
    """Every prompt's ids, read again."""

    def ids() -> Iterator[list[int]]:
        for window in lines():
            yield from (prompt.ids for _, (_, prompt, _) in window)

    return ids


def _rows(config: Any, ask: ManyAsk, sites: Sequence[str] = ("resid",)) -> int | None:
    """Rows per window so that the logits kept fit KEEP_BYTES (None: the config cannot say):
    with `sites`, B's rows inside the blocks too (float64, a row per site and layer)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    blocks = getattr(text, "num_hidden_layers", None)
    if not isinstance(vocab, int) or not isinstance(blocks, int) or vocab < 1:
        return None
    layers = blocks + 1  # every layer runs: the first divergent one is found among all
    inside = 0 if tuple(sites) == ("resid",) else len(sites) * blocks * vocab * 8
    return max(1, KEEP_BYTES // (3 * layers * vocab * 4 + inside))
