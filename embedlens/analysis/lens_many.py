"""`lens(model, prompts=[...])`: the lens over many prompts, the model loaded once.

Every prompt is checked before the model loads (a bad one stops the run with its line number,
or is counted and skipped with `skip_bad`). Then prompts are read again one window at a time,
run in batches (`lens_batch`), handed to `each` as the report a single run gives, and folded into
per-layer statistics (`lens_stats`): memory does not grow with the number of prompts.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from embedlens.analysis.lens import (
    _Ask,
    _builtin_code_note,
    _eval_mode,
    _Load,
    _offload_dir,
    _position_index,
    _prepare,
    _Prompt,
    _report,
    _template_name,
    layer_items,
    parse_position,
    resolve_layers,
    template_switches,
)
from embedlens.errors import UsageError
from embedlens.model.prompts import BadLine, PromptLine, PromptSource
from embedlens.reports.lens import LensLayerStats, LensReport, LensSummaryReport

if TYPE_CHECKING:
    from torch import nn

    from embedlens.analysis.lens_batch import BatchOut
    from embedlens.analysis.lens_stats import LensStats

EachFn = Callable[[LensReport, PromptLine], None]
"""Called with each prompt's report (what a single run returns) and the prompt's line."""
WINDOW = 64
"""Prompts read ahead and run together (in batches of similar length)."""
_SHOWN_BAD = 5


@dataclass(frozen=True)
class Many:
    """What is asked for every prompt (each line adds its prompt, target and chat)."""

    layers: Any
    position: int | list[int] | None
    top_k: int
    switches: dict[str, Any]
    skip_bad: bool
    each: EachFn | None
    template: tuple[str, str] | None = None
    """A chat template the caller gave, for the lines with a chat message."""


def parse_positions(value: int | str | Sequence[int]) -> int | list[int] | None:
    """-1 (an int), 'all' (None), or a list of positions ('3,5,-1' or [3, 5, -1])."""
    if isinstance(value, str) and "," in value:
        try:
            return [int(part) for part in value.split(",")]
        except ValueError:
            raise UsageError(
                f"--position must be an integer, 'all' or a list such as 3,5,-1, not '{value}'"
            ) from None
    if isinstance(value, (list, tuple)):
        if not value or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise UsageError(f"position must be an integer, 'all' or a list of them: {value!r}")
        return list(value)
    assert isinstance(value, (int, str))
    return parse_position(value)


def many(
    top_k: int,
    layers: str | Sequence[int] | None,
    position: int | str | Sequence[int],
    no_thinking: bool,
    template_args: Mapping[str, Any] | Sequence[str] | None,
    skip_bad: bool,
    each: EachFn | None,
    template: tuple[str, str] | None = None,
) -> Many:
    """Check the options that apply to every prompt, before any file is read."""
    if top_k < 1:
        raise UsageError(f"-k must be at least 1, not {top_k}")
    items = None if layers is None else layer_items(layers)
    switches = template_switches(no_thinking, template_args)
    return Many(items, parse_positions(position), top_k, switches, skip_bad, each, template)


def source_of(prompts: Iterable[str | Mapping[str, Any]] | PromptSource) -> PromptSource:
    """The prompts as a source read twice (a Python list is taken as it is)."""
    return PromptSource.of(prompts)


def prepare_line(
    line: PromptLine, ask: Many, tokenizer: Any, config: Any, template: str
) -> tuple[_Ask, _Prompt, list[int] | None]:
    """One line as a single run would take it: its ask, its prompt, and the absolute positions
    read (None: the position of the single run)."""
    empty = _empty(line)
    if empty is not None:
        raise empty
    pos = ask.position
    single = pos[-1] if isinstance(pos, list) else pos
    one = _Ask(line.prompt, line.chat, ask.switches, ask.layers, single, ask.top_k, line.target,
               pos is None, ask.template)  # fmt: skip
    try:
        prompt = _prepare(one, tokenizer, config, template)
        listed = None
        if isinstance(pos, list):
            listed = sorted({_position_index(p, len(prompt.ids)) for p in pos})
    except BadLine:
        raise
    except UsageError as e:
        raise BadLine(line.line, e.message, hint=e.hint) from None
    return one, prompt, listed


def _empty(line: PromptLine) -> BadLine | None:
    """A line whose prompt is empty (and that has no chat message to run instead)."""
    if not line.prompt.strip() and line.chat is None:
        return BadLine(line.line, "the prompt is empty")
    return None


def check_file(source: PromptSource, ask: Many) -> None:
    """What a file's lines show without a tokenizer (JSON, keys, types, empty prompts), checked
    one line at a time before anything heavy is imported: the first bad line stops the run here
    unless `skip_bad`, as does a file without a prompt. stdin and Python lists are left to
    `check_all` (stdin is not read ahead for this)."""
    if source.path is None:
        return
    good, n_bad = 0, 0
    for line in source:
        bad = line if isinstance(line, BadLine) else _empty(line)
        if bad is None:
            good += 1
        elif not ask.skip_bad:
            raise bad
        else:
            n_bad += 1
    if good == 0:
        raise _nothing_to_run(n_bad)


def check_all(
    source: PromptSource, ask: Many, tokenizer: Any, config: Any, template: str
) -> tuple[int, list[BadLine]]:
    """Every line checked (before the model loads): the prompts that will run, the bad lines
    (the first few kept for notes); the first bad one raises unless `skip_bad`."""
    good, n_bad = 0, 0
    bad: list[BadLine] = []
    for line in source:
        try:
            if isinstance(line, BadLine):
                raise line
            prepare_line(line, ask, tokenizer, config, template)
            good += 1
        except BadLine as e:
            if not ask.skip_bad:
                raise
            n_bad += 1
            if len(bad) < _SHOWN_BAD:
                bad.append(e)
    if good == 0:
        raise _nothing_to_run(n_bad)
    return n_bad, bad


def _nothing_to_run(n_bad: int) -> UsageError:
    return UsageError(
        "no prompt to run" + (f": all {n_bad} lines are bad" if n_bad else ": the input is empty")
    )


def bad_notes(n_bad: int, shown: list[BadLine]) -> list[str]:
    """Notes for the lines skipped with --skip-bad."""
    notes = [f"skipped line {e.line}: {e.reason}" for e in shown]
    if n_bad > len(shown):
        notes.append(f"skipped {n_bad - len(shown)} more bad lines")
    return notes


def lens_files(
    name: str, source: PromptSource, ask: Many, load: _Load, tokenizer: Any
) -> LensSummaryReport:
    """The lens over many prompts on a model that embedlens loads from its files."""
    check_file(source, ask)  # before the imports below bring in torch and transformers
    from embedlens.io.source import resolve
    from embedlens.model import loading
    from embedlens.model.gguf_patches import gguf_reads_shared

    trust = load.trust_remote_code
    with _offload_dir(load.device_map, load.offload_folder) as folder:
        src = resolve(name, load.revision)
        with gguf_reads_shared(src):
            loading.check_source(src, trust_remote_code=trust)
            if tokenizer is None:
                tokenizer = loading.load_tokenizer(src, trust_remote_code=trust)
            config = loading.hf_config(src, trust_remote_code=trust)
            template = _template_name(src)
            n_bad, bad = check_all(source, ask, tokenizer, config, template)
            load_notes: list[str] = []
            model = loading.load_model(
                src, dtype=load.dtype, device=load.device, device_map=load.device_map,
                max_memory=load.max_memory, offload_folder=folder, trust_remote_code=trust,
                config=config, notes=load_notes,
            )  # fmt: skip
        built_in = _builtin_code_note(config, trust_remote_code=trust)
        around = (load_notes, [] if built_in is None else [built_in])
        run = _Run(name, model, tokenizer, config, template, ask, around)
        return run.all(source, n_bad, bad)


def lens_loaded(
    model: nn.Module, source: PromptSource, ask: Many, tokenizer: Any
) -> LensSummaryReport:
    """The lens over many prompts on a model the caller loaded (run as it is)."""
    name = str(getattr(model, "name_or_path", None) or type(model).__name__)
    config = getattr(model, "config", None)
    template = f"the chat template of '{name}'"
    n_bad, bad = check_all(source, ask, tokenizer, config, template)
    with _eval_mode(model):
        run = _Run(name, model, tokenizer, config, template, ask, ([], []))
        return run.all(source, n_bad, bad)


class _Run:
    """The second reading: prompts run a window at a time, reports handed on, statistics kept."""

    def __init__(
        self,
        name: str,
        model: nn.Module,
        tokenizer: Any,
        config: Any,
        template: str,
        ask: Many,
        around: tuple[list[str], list[str]],
    ) -> None:
        from embedlens.analysis.lens_batch import BatchLens
        from embedlens.analysis.lens_engine import find_blocks
        from embedlens.analysis.lens_stats import LensStats

        n_blocks = len(find_blocks(model).modules)
        every = list(range(n_blocks + 1))
        layers = every if ask.layers is None else resolve_layers(ask.layers, n_blocks)
        self.name, self.model, self.tokenizer = name, model, tokenizer
        self.config, self.template, self.ask, self.around = config, template, ask, around
        k = ask.top_k if ask.each is not None else 1  # the statistics read the top-1 alone
        self.batch = BatchLens(model, layers, k, len(tokenizer))
        self.stats: LensStats = LensStats()

    def all(self, source: PromptSource, n_bad: int, bad: list[BadLine]) -> LensSummaryReport:
        """Every prompt run, freed memory kept in the process meanwhile (`runtime.py`: the decode
        allocates and frees hundreds of large chunks)."""
        from embedlens.runtime import heap_kept

        with heap_kept():
            return self._all(source, n_bad, bad)

    def _all(self, source: PromptSource, n_bad: int, bad: list[BadLine]) -> LensSummaryReport:
        window: list[tuple[PromptLine, _Ask, _Prompt, list[int] | None]] = []
        for line in source:
            if isinstance(line, BadLine):
                continue
            try:
                window.append((line, *self._prepare(line)))
            except BadLine:
                continue
            if len(window) >= WINDOW:
                self._flush(window)
                window = []
        if window:
            self._flush(window)
        return self._summary(n_bad, bad)

    def _prepare(self, line: PromptLine) -> tuple[_Ask, _Prompt, list[int] | None]:
        return prepare_line(line, self.ask, self.tokenizer, self.config, self.template)

    def _flush(self, window: list[tuple[PromptLine, _Ask, _Prompt, list[int] | None]]) -> None:
        from embedlens.analysis.lens_batch import BatchItem

        items = []
        for _, ask, prompt, listed in window:
            positions = listed or (
                list(range(len(prompt.ids))) if ask.position is None else [prompt.index]
            )
            items.append(BatchItem(prompt.ids, positions, prompt.target_id, prompt.index))
        outs = self.batch.run(items)
        for (line, ask, prompt, _), out in zip(window, outs, strict=True):
            self.stats.add(out.result, out.kl, out.model_top1)
            if self.ask.each is not None:
                self.ask.each(self._report(ask, prompt, out), line)

    def _report(self, ask: _Ask, prompt: _Prompt, out: BatchOut) -> LensReport:
        """The report a single run on this prompt gives (notes too)."""
        report = _report(self.name, self.tokenizer, self.model, out.result, ask, prompt)
        before, after = self.around
        notes = [*prompt.notes, *before, *report.notes, *after]
        return dataclasses.replace(report, notes=notes)

    def _summary(self, n_bad: int, bad: list[BadLine]) -> LensSummaryReport:
        stats = self.stats
        rows = [LensLayerStats(**dataclasses.asdict(s)) for s in stats.summary()]
        pos = self.ask.position
        return LensSummaryReport(
            model=self.name,
            n_prompts=stats.n_prompts,
            n_positions=stats.n_positions,
            n_skipped=n_bad,
            n_targets=stats.n_targets,
            position="all" if pos is None else pos,
            num_layers=self.batch.n_layers,
            dtype=str(next(self.model.parameters()).dtype).removeprefix("torch."),
            layers=rows,
            notes=[*self.around[0], *bad_notes(n_bad, bad), *self.around[1]],
        )


def is_path(model: object) -> bool:
    return isinstance(model, (str, os.PathLike))
