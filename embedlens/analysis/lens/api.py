"""`lens` and `lens_prompts`: the logit lens from Python, on one prompt or many.

Each checks what it is asked before any file is read (`options`), gets the model ready one way
(`opening`), runs the engine, and builds the report. A model given already loaded is used as it
is: never reloaded, moved, re-typed or left changed.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar, overload

from embedlens.analysis.lens import options
from embedlens.analysis.lens.many import EachFn
from embedlens.analysis.lens.prompt import Prompt, prepare
from embedlens.errors import UsageError

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase

    from embedlens.analysis.lens.opening import Check, Opened
    from embedlens.analysis.tune.folder import LensFolder
    from embedlens.analysis.tune.use import Through
    from embedlens.model.prompts import PromptSource
    from embedlens.reports.lens import LensReport, LensSummaryReport

T = TypeVar("T")


@overload
def lens(model: str | os.PathLike[str] | nn.Module, prompt: str, **options: Any) -> LensReport: ...


@overload
def lens(
    model: str | os.PathLike[str] | nn.Module,
    prompt: None = None,
    *,
    prompts: Iterable[str | Mapping[str, Any]] | PromptSource,
    **options: Any,
) -> LensSummaryReport: ...


def lens(  # type: ignore[misc]  # the overloads take options as **options
    model: str | os.PathLike[str] | nn.Module,
    prompt: str | None = None,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    layers: str | Sequence[int] | None = None,
    top_k: int = 5,
    position: int | str = -1,
    target: str | None = None,
    chat: str | None = None,
    no_thinking: bool = False,
    template_args: Mapping[str, Any] | Sequence[str] | None = None,
    chat_template: str | os.PathLike[str] | None = None,
    grid: bool = False,
    device_map: str | None = None,
    max_memory: Mapping[int | str, int | str] | str | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    revision: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    trust_remote_code: bool = False,
    prompts: Iterable[str | Mapping[str, Any]] | PromptSource | None = None,
    each: EachFn | None = None,
    skip_bad: bool = False,
    tuned: str | os.PathLike[str] | None = None,
) -> LensReport | LensSummaryReport:
    """Decode every layer's residual stream with the model's own final norm, head and post-head
    steps; the report's `check` says whether that reproduces the model's logits.

    model: a hub id, a folder, a .gguf file, or a loaded transformers model (then `tokenizer` is
        required, and the loading options must stay at their defaults: it runs as it is).
    layers: '0,4,8', '20:', '0:10:2' or a list of layers (0 = the embedding output); all by default.
    position: the token position read (-1 = the last), or 'all' for the layer x position grid.
    chat: a user message to apply the chat template to; `prompt` then starts the answer.
    template_args: more template variables, as a dict or as 'KEY=VALUE' strings.
    chat_template: the chat template to use instead of the tokenizer's (for a model without
        one): a str is the template's Jinja text, a Path (any os.PathLike) a file holding it.
    grid: compute the layer x position grid even when one position is read (for a heatmap).
    max_memory: with `device_map`, memory per device, as a dict or as 'cpu=8GiB,0=20GiB'.
    tuned: a lens folder (`tune`'s or tuned-lens's): each layer but the last read through it.

    Many prompts: `lens_prompts` (`lens(model, prompts=...)` calls it, deprecated: it goes soon).
    """
    if prompts is not None or prompt is None:
        options.one_prompt_only(target, chat, grid)
        many_options = dict(
            tokenizer=tokenizer, layers=layers, top_k=top_k, position=position,
            no_thinking=no_thinking, template_args=template_args, chat_template=chat_template,
            each=each, skip_bad=skip_bad, device_map=device_map, max_memory=max_memory,
            offload_folder=offload_folder, revision=revision, dtype=dtype, device=device,
            trust_remote_code=trust_remote_code, tuned=tuned,
        )  # fmt: skip
        return _deprecated_many(model, prompt, prompts, many_options)
    ask = options.ask(prompt, layers, top_k, position, target, chat, no_thinking, template_args,
                      grid, chat_template)  # fmt: skip
    loading = _loading(model, revision, dtype, device, device_map, max_memory, offload_folder,
                       trust_remote_code)  # fmt: skip
    check = _checked_with(lens_dir := _tuned_folder(tuned), functools.partial(prepare, ask))
    with _opened(model, tokenizer, loading, check) as (opened, run):
        return _one(opened, ask, run, _ready(lens_dir, opened))


def lens_prompts(
    model: str | os.PathLike[str] | nn.Module,
    prompts: Iterable[str | Mapping[str, Any]] | PromptSource,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    layers: str | Sequence[int] | None = None,
    top_k: int = 5,
    position: int | str | Sequence[int] = -1,
    no_thinking: bool = False,
    template_args: Mapping[str, Any] | Sequence[str] | None = None,
    chat_template: str | os.PathLike[str] | None = None,
    each: EachFn | None = None,
    skip_bad: bool = False,
    device_map: str | None = None,
    max_memory: Mapping[int | str, int | str] | str | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    revision: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    trust_remote_code: bool = False,
    tuned: str | os.PathLike[str] | None = None,
    compare_logit: bool = False,
) -> LensSummaryReport:
    """The lens over many prompts, the model loaded once: per-layer statistics (KL from the
    model's output, entropy, top-1 agreement, the target's probability and rank).

    prompts: strings, or dicts with `prompt` and optional `target`, `chat` (a user message) and
        `id`; or `PromptSource.open(path)` (a file of one prompt per line or JSON Lines).
    position: -1, 'all', or a list of positions read in every prompt.
    each: called as `each(report, line)` with each prompt's `LensReport` (what `lens` returns
        for it) as it comes.
    skip_bad: skip (and count) bad prompts instead of stopping at the first.
    compare_logit: with `tuned`, the logit lens's statistics over the same prompts too (the
        summary's `logit_layers`); the prompts run through both lenses.
    The other options are `lens`'s.
    """
    from embedlens.analysis.lens import many
    from embedlens.model.prompts import PromptSource

    ask = options.many(top_k, layers, position, no_thinking, template_args, skip_bad,
                       chat_template)  # fmt: skip
    if compare_logit and tuned is None:
        raise UsageError(
            "--compare-logit compares the tuned lens with the logit lens: give --tuned"
        )
    lens_dir = _tuned_folder(tuned)
    source = PromptSource.of(prompts)
    loading = _loading(model, revision, dtype, device, device_map, max_memory, offload_folder,
                       trust_remote_code)  # fmt: skip
    if isinstance(loading, options.Load):
        many.check_file(source, ask)  # before the imports that loading brings in

    def check_lines(tok: Any, config: Any, template: str) -> tuple[int, list[Any]]:
        return many.check_all(source, ask, tok, config, template)

    check = _checked_with(lens_dir, check_lines)
    with _opened(model, tokenizer, loading, check) as (opened, (n_bad, bad)):
        through = _ready(lens_dir, opened)
        run = many.ManyRun(opened, ask, each, through, compare_logit=compare_logit)
        return run.all(source, n_bad, bad)


def _deprecated_many(
    model: str | os.PathLike[str] | nn.Module,
    prompt: str | None,
    prompts: Iterable[str | Mapping[str, Any]] | PromptSource | None,
    many_options: dict[str, Any],
) -> LensSummaryReport:
    """`lens(model, prompts=...)`, the former spelling of `lens_prompts`."""
    if prompts is None:
        raise UsageError("give a prompt, or many with lens_prompts(model, prompts)")
    if prompt is not None:
        raise UsageError("give either a prompt or prompts=, not both")
    warnings.warn(
        "lens(model, prompts=...) is deprecated: use lens_prompts(model, prompts, ...)",
        DeprecationWarning,
        stacklevel=3,
    )
    return lens_prompts(model, prompts, **many_options)


def _tuned_folder(tuned: str | os.PathLike[str] | None) -> LensFolder | None:
    """The lens folder given, checked without torch (None without one)."""
    if tuned is None:
        return None
    from embedlens.analysis.tune.use import open_tuned

    return open_tuned(tuned)


def _checked_with(lens_dir: LensFolder | None, check: Check[T]) -> Check[T]:
    """`check`, after the tuned lens's size is checked against the model's config."""
    if lens_dir is None:
        return check

    def both(tok: Any, config: Any, template: str) -> T:
        from embedlens.analysis.tune.use import before_load

        before_load(lens_dir, config)
        return check(tok, config, template)

    return both


def _ready(lens_dir: LensFolder | None, opened: Opened) -> Through | None:
    """The tuned lens checked against the loaded model, as a decoder maker (None without one)."""
    if lens_dir is None:
        return None
    from embedlens.analysis.tune.use import ready

    return ready(lens_dir, opened.model, opened.tokenizer)


def _one(
    opened: Opened, ask: options.Ask, run: Prompt, through: Through | None = None
) -> LensReport:
    """One prompt through the engine (and the tuned lens, when given), and its report."""
    from embedlens.analysis.lens.blocks import find_blocks
    from embedlens.analysis.lens.decoder import ModelDecoder
    from embedlens.analysis.lens.engine import run_lens
    from embedlens.analysis.lens.report import lens_report

    model = opened.model
    decoder = None
    if through is not None:
        decoder = through[0](ModelDecoder(model, find_blocks(model), dummy_id=run.ids[0]))
    result = run_lens(
        model,
        run.ids,
        layers=options.resolve_layers(ask.layers, len(find_blocks(model).modules)),
        positions=list(range(len(run.ids))) if ask.grid else [run.index],
        k=ask.top_k,
        real_vocab=len(opened.tokenizer),
        target=run.target_id,
        full_at=[run.index],
        decoder=decoder,
    )
    around = (opened.before, opened.after)
    report = lens_report(opened.name, opened.tokenizer, model, result, ask, run, around)
    if through is None:
        return report
    from embedlens.reports.tune import tuned_report

    return tuned_report(report, through[1])


def _loading(
    model: object,
    revision: str | None,
    dtype: str,
    device: str,
    device_map: str | None,
    max_memory: Mapping[int | str, int | str] | str | None,
    offload_folder: str | os.PathLike[str] | None,
    trust_remote_code: bool,
) -> options.Load | dict[str, bool]:
    """How to load a model named by its files, checked; for a model already loaded, which
    loading options were given (it refuses them)."""
    given = (revision, dtype, device, device_map, max_memory, offload_folder, trust_remote_code)
    if isinstance(model, (str, os.PathLike)):
        return options.load_options(*given)
    return options.loading_given(*given)


@contextmanager
def _opened(
    model: object, tokenizer: Any, loading: options.Load | dict[str, bool], check: Check[T]
) -> Iterator[tuple[Opened, T]]:
    """The model ready for the run (loaded from its files, or as the caller loaded it), with
    what `check` returned before any weight was read."""
    from embedlens.analysis.lens import opening

    if isinstance(loading, options.Load):
        assert isinstance(model, (str, os.PathLike))
        with opening.from_files(os.fspath(model), loading, tokenizer, check) as ready:
            yield ready
    else:
        with opening.from_loaded(model, tokenizer, loading, check) as ready:
            yield ready
