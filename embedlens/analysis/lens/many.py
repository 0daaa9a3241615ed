"""The lens over one prompt (`run_one`) and over many, the model loaded once.

Every prompt is checked before the model loads (a bad one stops the run with its line number, or
is counted and skipped with `skip_bad`). Then prompts are read again one window at a time, run in
batches (`batch`), handed to `each` as the report a single run gives, and folded into per-layer
statistics (`LensStats`, sums of `stats`): memory does not grow with the number of prompts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from itertools import chain
from typing import TYPE_CHECKING, Any, TypeVar

from embedlens.analysis.lens.opening import Prompt, make_prompt, position_index
from embedlens.analysis.lens.options import Ask, ManyAsk, resolve_layers
from embedlens.analysis.lens.report import dtype_name, one_report
from embedlens.analysis.lens.stats import LAYER_STATS, Sums, add_row
from embedlens.errors import UsageError
from embedlens.model.prompts import BadLine, PromptLine, PromptSource
from embedlens.progress import Progress, no_progress
from embedlens.reports.lens import LensLayerStats, LensReport, LensSummaryReport

if TYPE_CHECKING:
    import torch

    from embedlens.analysis.dist import Session
    from embedlens.analysis.lens.blocks import Decoder
    from embedlens.analysis.lens.decoders import Through
    from embedlens.analysis.lens.engine import KL, BatchOut
    from embedlens.analysis.lens.opening import Opened
    from embedlens.analysis.lens.report import LensResult
    from embedlens.analysis.lens.states_file import ManySaver

OnReport = Callable[[LensReport, PromptLine], None]
"""A result callback: called with each prompt's report (what a single run returns) and the
prompt's line."""
T = TypeVar("T")
WINDOW = 64
"""Prompts read ahead and run together (in batches of similar length)."""
_SHOWN_BAD = 5

Prepared = tuple[Ask, Prompt, list[int] | None]
"""A line's ask, its prompt, and the absolute positions read (None: the single run's)."""
Window = list[tuple[PromptLine, Prepared]]
"""Lines run together, each with what `prepare_line` made of it."""


def prepare_line(
    line: PromptLine, ask: ManyAsk, tokenizer: Any, config: Any, template: str
) -> Prepared:
    """One line as a single run would take it: its ask, its prompt, and the absolute positions
    read (None: the position of the single run)."""
    _not_empty(line)
    one = ask.line(line.prompt, line.chat, line.target)
    pos = ask.position
    try:
        prompt = make_prompt(one, tokenizer, config, template)
        listed = None
        if isinstance(pos, list):
            listed = sorted({position_index(p, len(prompt.ids)) for p in pos})
    except BadLine:
        raise
    except UsageError as e:
        raise BadLine(line.line, e.message, hint=e.hint) from None
    return one, prompt, listed


def _not_empty(line: PromptLine) -> None:
    """A line whose prompt is empty (and that has no chat message to run instead) is bad."""
    if not line.prompt.strip() and line.chat is None:
        raise BadLine(line.line, "the prompt is empty")


def run_one(
    opened: Opened,
    ask: Ask,
    run: Prompt,
    *,
    keep: bool = False,
    other: dict[int, torch.Tensor] | None = None,
    decoder: Decoder | None = None,
) -> LensResult:
    """The engine on one prompt: the layers asked for at the position read (every position for
    the grid); `keep` and `other` as `engine.run_lens` takes them (a comparison); `decoder`: the
    model's own by default (a tuned lens's otherwise)."""
    from embedlens.analysis.lens.engine import run_lens

    return run_lens(
        opened.model,
        run.ids,
        layers=ask.layers,
        positions=list(range(len(run.ids))) if ask.grid else [run.index],
        k=ask.top_k,
        real_vocab=len(opened.tokenizer),
        target=run.target_id,
        full_at=[run.index],
        keep=keep,
        other=other,
        decoder=decoder,
    )


def check_file(source: PromptSource, ask: ManyAsk) -> None:
    """What a file's lines show without a tokenizer (JSON, keys, types, empty prompts), checked
    one line at a time before anything heavy is imported, as `check_all` checks them. stdin
    and Python lists are left to `check_all` (stdin is not read ahead for this)."""
    if source.path is not None:
        _bad_lines(source, ask, _not_empty)


def check_targets(source: PromptSource, ask: ManyAsk, one: Callable[[str], None]) -> None:
    """Every line's target checked with `one` (a GGUF file's own tokenizer, before transformers
    builds its): the first that is not one token stops the run with what `check_all` would
    say of its line. With `skip_bad` they are left to `check_all` to count."""
    if ask.skip_bad:
        return
    for line in source:
        if isinstance(line, PromptLine) and line.target is not None:
            try:
                one(line.target)
            except UsageError as e:
                raise BadLine(line.line, e.message, hint=e.hint) from None


def plain_texts(source: PromptSource) -> Iterator[str]:
    """Each line's prompt (but a chat message's: the template's text is encoded around it) and
    target, in order: the texts the run encodes as they are (`opening.from_files`' `texts`)."""
    for line in source:
        if isinstance(line, PromptLine):
            if line.chat is None:
                yield line.prompt
            if line.target is not None:
                yield line.target


def check_all(
    source: PromptSource, ask: ManyAsk, tokenizer: Any, config: Any, template: str
) -> tuple[int, list[BadLine]]:
    """Every line checked (before the model loads): the bad lines (the first few kept for
    notes)."""
    return _bad_lines(
        source, ask, lambda line: prepare_line(line, ask, tokenizer, config, template)
    )


def _bad_lines(
    source: PromptSource, ask: ManyAsk, check: Callable[[PromptLine], object]
) -> tuple[int, list[BadLine]]:
    """Every line checked with `check` (BadLine when it is bad): how many are bad, and the
    first few; the first bad one raises unless `skip_bad`, as does an input without a prompt."""
    good, n_bad = 0, 0
    bad: list[BadLine] = []
    for line in source:
        try:
            if isinstance(line, BadLine):
                raise line
            check(line)
            good += 1
        except BadLine as e:
            if not ask.skip_bad:
                raise
            n_bad += 1
            if len(bad) < _SHOWN_BAD:
                bad.append(e)
    if good == 0:
        what = f": all {n_bad} lines are bad" if n_bad else ": the input is empty"
        raise UsageError("no prompt to run" + what)
    return n_bad, bad


def bad_notes(n_bad: int, shown: list[BadLine]) -> list[str]:
    """Notes for the lines skipped with --skip-bad."""
    notes = [f"skipped line {e.line}: {e.reason}" for e in shown]
    if n_bad > len(shown):
        notes.append(f"skipped {n_bad - len(shown)} more bad lines")
    return notes


def positions_read(prepared: Prepared) -> list[int]:
    """The absolute positions a prepared line reads."""
    ask, prompt, listed = prepared
    if listed is not None:
        return listed
    return list(range(len(prompt.ids))) if ask.position is None else [prompt.index]


def windows(
    source: PromptSource,
    ask: ManyAsk,
    tokenizer: Any,
    config: Any,
    template: str,
    *,
    rows: int | None = None,
) -> Iterator[Window]:
    """The good lines, prepared, WINDOW at a time (fewer once they read `rows` rows)."""
    window: Window = []
    n_rows = 0
    for line in source:
        if isinstance(line, BadLine):
            continue
        try:
            prepared = prepare_line(line, ask, tokenizer, config, template)
        except BadLine:
            continue
        window.append((line, prepared))
        n_rows += len(positions_read(prepared))
        if len(window) >= WINDOW or (rows is not None and n_rows >= rows):
            yield window
            window, n_rows = [], 0
    if window:
        yield window


def in_rounds(items: Iterable[T], session: Session, hand_on: Callable[[], None]) -> Iterator[T]:
    """Under torchrun: this process's items (item w runs on rank w mod N), `hand_on` called on
    every rank after each round of N items and after the last (a round cut short)."""
    count = 0
    for count, item in enumerate(items, 1):
        session.check()
        if (count - 1) % session.size == session.rank:
            yield item
        if count % session.size == 0:
            hand_on()
    if count % session.size:
        hand_on()


class ManyRun:
    """The second reading: prompts run a window at a time, reports handed on, statistics kept."""

    def __init__(
        self,
        opened: Opened,
        ask: ManyAsk,
        each: OnReport | None,
        through: Through | None = None,
        *,
        keep: bool = False,
        compare_logit: bool = False,
        every: bool = False,
    ) -> None:
        from embedlens.analysis.lens.blocks import find_blocks
        from embedlens.analysis.lens.engine import BatchLens

        model = opened.model
        n_blocks = len(find_blocks(model).modules)
        layers = resolve_layers(ask.layers, n_blocks)  # checked even when every layer runs
        self.shown = layers
        """The layers reports and the summary hold; with `every`, every layer is run (a pair's
        first divergent layer is found among all of them) and cut to these."""
        if every:
            layers = resolve_layers(None, n_blocks)
        self.opened, self.ask, self.each, self.through = opened, ask, each, through
        # the statistics read the top-1 alone; reports (`each`, a comparison's) the top-k
        k = ask.top_k if each is not None or keep else 1
        wrap = None if through is None else through.wrap
        self.batch = BatchLens(model, layers, k, len(opened.tokenizer), keep, wrap=wrap)
        self.stats = LensStats()
        self.logit: tuple[BatchLens, LensStats] | None = None
        """With compare_logit: the logit lens over the same prompts, for its statistics."""
        if compare_logit and through is not None:
            self.logit = BatchLens(model, layers, 1, len(opened.tokenizer)), LensStats()
        self.split_note: str | None = None
        self.saver: ManySaver | None = None
        """With --save-states: each prompt's states written (`saving.ManySaver`)."""

    def run_all(
        self,
        source: PromptSource,
        n_bad: int,
        bad: list[BadLine],
        session: Session | None = None,
        progress: Progress = no_progress,
    ) -> LensSummaryReport:
        """Every prompt run (`session`: split over processes; `progress` told after each window,
        of every process's prompts), freed memory kept in the process meanwhile
        (`runtime.heap_kept`: the decode allocates and frees hundreds of large chunks)."""
        from embedlens.runtime import heap_kept

        o = self.opened
        with heap_kept():
            found = windows(source, self.ask, o.tokenizer, o.config, o.template)
            if session is None:
                done = 0
                for window in found:
                    self.run_window(window)
                    done += len(window)
                    progress("prompts", done, 0, "prompts")
            else:
                self._split(found, session, progress)
            return self.summary(n_bad, bad)

    def _split(self, found: Iterator[Window], session: Session, progress: Progress) -> None:
        """Under torchrun: window w runs on rank w mod N (so each prompt runs in the batch one
        process gives it, and its report is the same bytes); after each round of N windows,
        rank 0 hands their reports on in input order; the statistics are summed at the end."""
        each = self.each
        kept: list[tuple[LensReport, PromptLine]] = []
        if each is not None:  # reports are built where `each` is given (on every process)
            self.each = lambda report, line: kept.append((report, line))
        if self.saver is not None:  # rank 0 writes every rank's states
            self.saver.keep = session.rank != 0
        ran = 0
        for window in in_rounds(found, session, lambda: self._hand_on(session, kept, each)):
            self.run_window(window)
            ran += 1
            progress("prompts", session.total("prompts", len(window)), 0, "prompts")
        self.each = each
        self._merge(session, ran)

    def _hand_on(
        self, session: Session, kept: list[tuple[LensReport, PromptLine]], each: OnReport | None
    ) -> None:
        """A round's reports, gathered on rank 0 and handed to `each` there in input order (the
        round's windows are in rank order), and the states saved, handed to rank 0."""
        parts = session.gather(list(kept))
        kept.clear()
        if each is not None:
            for report, line in chain.from_iterable(parts or []):
                each(report, line)
        if self.saver is not None:
            self.saver.hand_on(session)

    def _merge(self, session: Session, ran: int) -> None:
        """Every process's statistics summed (in rank order), and the note of who ran what."""

        parts = session.all_gather((self.stats, None if self.logit is None else self.logit[1], ran))
        self.stats = LensStats.merged([p[0] for p in parts])
        if self.logit is not None:
            self.logit = self.logit[0], LensStats.merged([p[1] for p in parts])
        runs = ", ".join(f"rank {r}: {p[2]}" for r, p in enumerate(parts))
        self.split_note = (
            f"split over {session.size} processes (torchrun, {session.backend}): window w of "
            f"{WINDOW} prompts ran on rank w mod {session.size} (windows run by {runs})"
        )

    def run_window(
        self, window: Window, others: list[dict[int, Any]] | None = None
    ) -> list[BatchOut]:
        """One window's prompts in batches, their statistics kept and their reports handed on;
        `others`: another model's residual for each (a comparison: `BatchItem.other`)."""
        from embedlens.analysis.lens.engine import BatchItem

        items = []
        for i, (_, prepared) in enumerate(window):
            prompt, positions = prepared[1], positions_read(prepared)
            other = None if others is None else others[i]
            items.append(BatchItem(prompt.ids, positions, prompt.target_id, prompt.index, other))
        outs = self.batch.run(items)
        if self.logit is not None:
            for out in self.logit[0].run(items):
                self.logit[1].add(out.result, out.kl, out.model_top1)
        for (line, (ask, prompt, _)), out in zip(window, outs, strict=True):
            self.stats.add(out.result, out.kl, out.model_top1)
            if self.saver is not None:
                self.saver.add(line, ask, prompt)
            if self.each is not None:
                self.each(self.report(ask, prompt, out), line)
        return outs

    def report(self, ask: Ask, prompt: Prompt, out: BatchOut) -> LensReport:
        """The report a single run on this prompt gives (notes too)."""
        report = one_report(self.opened, ask, prompt, shown_rows(out.result, self.shown))
        if self.through is None:
            return report
        return dataclasses.replace(report, **self.through.fields)

    def summary(self, n_bad: int, bad: list[BadLine]) -> LensSummaryReport:
        """The per-layer statistics of every prompt run so far."""
        stats, o = self.stats, self.opened
        pos = self.ask.position
        summary = LensSummaryReport(
            model=o.name,
            n_prompts=stats.n_prompts,
            n_positions=stats.n_positions,
            n_skipped=n_bad,
            n_targets=stats.n_targets,
            position="all" if pos is None else pos,
            num_layers=self.batch.n_layers,
            dtype=dtype_name(o.model),
            layers=[row for row in stats.summary() if row.layer in self.shown],
            notes=[*o.before, *bad_notes(n_bad, bad), *o.after],
        )
        if self.split_note is not None:
            summary.notes.append(self.split_note)
        if self.through is None:
            return summary
        logit = None if self.logit is None else self.logit[1].summary()
        return dataclasses.replace(summary, **self.through.fields, logit_layers=logit)


def shown_rows(result: LensResult, shown: list[int]) -> LensResult:
    """A result cut to the layers `shown` (itself when it holds no other)."""
    if result.layers == shown:
        return result
    rows = {key: top for key, top in result.rows.items() if key[0] in shown}
    return dataclasses.replace(result, layers=[x for x in result.layers if x in shown], rows=rows)


class LensStats:
    """Sums per layer, added to one prompt at a time."""

    def __init__(self) -> None:
        self._layers: dict[int, Sums] = {}
        self.n_prompts = 0
        self.n_positions = 0
        self.n_targets = 0

    def add(self, result: LensResult, kl: KL, model_top1: dict[int, int]) -> None:
        """One prompt: its decoded rows, (KL, entropy) for each (layer, position), and the
        model's own top-1 at each position."""
        self.n_prompts += 1
        self.n_positions += len(result.positions)
        has_target = False
        for layer in result.layers:
            acc = self._layers.setdefault(layer, Sums())
            for pos in result.positions:
                top = result.rows[(layer, pos)]
                k, h = kl[(layer, pos)]
                acc.add("kl", k)
                acc.add("entropy", h)
                acc.add("top1_agreement", int(top.ids[0] == model_top1[pos]))
                if top.target_rank is not None:
                    has_target = True
                    acc.add("target_prob", float(top.target_prob or 0.0))
                    acc.add("target_logprob", float(top.target_logprob or 0.0))
                    acc.rank("target_rank_median", top.target_rank)
                add_row(acc, top.stats)
        self.n_targets += int(has_target)

    @classmethod
    def merged(cls, parts: list[LensStats]) -> LensStats:
        """The statistics of every part together (its sums added, in the order given): the
        statistics of processes that each ran a share of the prompts."""
        out = cls()
        for part in parts:
            out.n_prompts += part.n_prompts
            out.n_positions += part.n_positions
            out.n_targets += part.n_targets
            for layer, acc in part._layers.items():
                out._layers.setdefault(layer, Sums()).update(acc)
        return out

    def summary(self) -> list[LensLayerStats]:
        """The means per layer, in layer order."""
        rows = sorted(self._layers.items())
        return [LensLayerStats(layer=layer, **acc.values(LAYER_STATS)) for layer, acc in rows]
