"""`lens` and `lens_prompts`: the logit lens from Python, on one prompt or many.

Each checks what it is asked before any file is read (`options`), gets the model ready one way
(`opening`), runs the engine, and builds the report. A model given already loaded is used as it
is: never reloaded, moved, re-typed or left changed.
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, TypeVar, overload

from embedlens.analysis.lens import options
from embedlens.analysis.lens.many import EachFn
from embedlens.analysis.lens.one import one_report, run_one
from embedlens.analysis.lens.opening import ready
from embedlens.analysis.lens.prompt import prepare
from embedlens.analysis.lens.site_report import check_sites, sites_report
from embedlens.errors import UsageError

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase

    from embedlens.analysis.dist import Session
    from embedlens.analysis.lens.decoder import Decoder
    from embedlens.analysis.lens.opening import Check, Opened
    from embedlens.analysis.lens.pairing import Pair
    from embedlens.analysis.lens.prompt import Prompt
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
    against: str | os.PathLike[str] | nn.Module | None = None,
    against_tokenizer: PreTrainedTokenizerBase | None = None,
    against_revision: str | None = None,
    threshold: float | None = None,
    tuned: str | os.PathLike[str] | None = None,
    save_states: str | os.PathLike[str] | None = None,
    site: str | Sequence[str] | None = None,
) -> LensReport | LensSummaryReport:
    """Decode every layer's residual stream with the model's own final norm, head and post-head
    steps; the report's `check` says whether that reproduces the model's logits.

    model: a hub id, a folder, a .gguf file, or a loaded transformers model (then `tokenizer` is
        required, and the loading options must stay at their defaults: it runs as it is).
    layers: '0,4,8', '20:', '0:10:2' or a list of layers (0 = the embedding output); all by default.
    position: the token position read (-1 = the last), or 'all' for the layer x position grid.
    chat: a user message to apply the chat template to; `prompt` then starts the answer.
    template_args: more template variables, as a dict or as 'KEY=VALUE' strings.
    chat_template: a template instead of the tokenizer's: its Jinja text (a str) or a file (a Path).
    grid: compute the layer x position grid even when one position is read (for a heatmap).
    max_memory: with `device_map`, memory per device, as a dict or as 'cpu=8GiB,0=20GiB'.
    against: B, read on the same ids and loaded as `model` (but `against_revision`); the report
        is then a `LensPairReport`, whose `diff` says where B parts from A (`threshold`: nats).
    tuned: a lens folder (`tune`'s or tuned-lens's): each layer but the last read through it.
    save_states: a file for every layer's residual stream at every position (`lens_states`).
    site: 'resid' (default), 'resid_mid', 'attn_out', 'mlp_out' or several: docs/lens.md.
    Many prompts: `lens_prompts` (`lens(model, prompts=...)` calls it, deprecated).
    """
    if prompts is not None or prompt is None:
        return _deprecated_many(model, prompt, prompts, locals())
    ask = options.ask(prompt, layers, top_k, position, target, chat, no_thinking, template_args,
                      grid, chat_template)  # fmt: skip
    loads = (revision, dtype, device, device_map, max_memory, offload_folder, trust_remote_code)
    asked = (against, against_tokenizer, against_revision, threshold)
    loading, pair = _models(model, tokenizer, loads, *asked)
    save = _saving(save_states, revision, pair, tuned, against)
    return _one_prompt(model, tokenizer, (loading, pair), ask, target, tuned, save, site)


def _saving(
    path: str | os.PathLike[str] | None,
    revision: str | None,
    pair: Pair | None,
    tuned: object,
    against: object,
) -> tuple[str | os.PathLike[str], str | None] | None:
    """Where --save-states writes, with the revision its metadata names (None: nowhere), once
    --tuned and --against are checked (`_not_both`)."""
    _not_both(tuned, against)
    if path is not None and pair is not None:
        raise UsageError("--save-states and --against do not combine: save each model's alone")
    return None if path is None else (path, revision)


def _one_prompt(
    model: object,
    tokenizer: Any,
    models: tuple[options.Load | dict[str, bool], Pair | None],
    ask: options.Ask,
    target: str | None,
    tuned: str | os.PathLike[str] | None,
    save: tuple[str | os.PathLike[str], str | None] | None = None,
    site: str | Sequence[str] | None = None,
) -> LensReport:
    """One prompt through the engine (a pair's, or through a tuned lens), and its report (with
    the sites inside the blocks, `site`)."""
    loading, pair = models
    sites = _sites(site, tuned)
    if pair is not None:
        from embedlens.analysis.lens.against import lens_pair

        return lens_pair(pair, ask, sites)
    own_template = ask.chat is not None and ask.template is None
    check = _checked_with(lens_dir := _tuned_folder(tuned), functools.partial(prepare, ask))
    with ready(model, tokenizer, loading, check, own_template, target) as (opened, run):
        through = _ready(lens_dir, opened)
        decoder = _tuned_decoder(through, opened, run)
        result = run_one(opened, ask, run, decoder=decoder)
        report = sites_report(one_report(opened, ask, run, result), opened, ask, run, result, sites)
        if save is not None:
            from embedlens.analysis.lens.saving import save_run

            save_run(save[0], opened, run, ask, save[1])
        if through is None:
            return report
        from embedlens.reports.tune import tuned_report

        return tuned_report(report, through[1])


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
    against: str | os.PathLike[str] | nn.Module | None = None,
    against_tokenizer: PreTrainedTokenizerBase | None = None,
    against_revision: str | None = None,
    threshold: float | None = None,
    tuned: str | os.PathLike[str] | None = None,
    compare_logit: bool = False,
    dist_backend: str = "auto",
    site: str | Sequence[str] | None = None,
) -> LensSummaryReport:
    """The lens over many prompts, the model loaded once: per-layer statistics (KL from the
    model's output, entropy, top-1 agreement, the target's probability and rank).

    prompts: strings, or dicts with `prompt` and optional `target`, `chat` (a user message) and
        `id`; or `PromptSource.open(path)` (a file of one prompt per line or JSON Lines).
    position: -1, 'all', or a list of positions read in every prompt.
    each: called as `each(report, line)` with each prompt's `LensReport` as it comes.
    skip_bad: skip (and count) bad prompts instead of stopping at the first.
    against: B (`against_tokenizer`: a loaded B's own, else A's is used); then a
        `LensPairSummaryReport`, with `each` given each prompt's `LensPairReport`.
    compare_logit: with `tuned`, the logit lens's statistics over the same prompts too (the
        summary's `logit_layers`); the prompts run through both lenses.
    dist_backend: under torchrun (WORLD_SIZE > 1), the process group's backend ('auto', 'gloo'
        or 'nccl'): window w of the prompts runs on rank w mod WORLD_SIZE, `each` is called on
        rank 0 with every prompt's report in input order, every rank returns the summary.
    site: a row of statistics per (layer, site); the other options are `lens`'s.
    """
    from embedlens.model.prompts import PromptSource

    ask = options.many(top_k, layers, position, no_thinking, template_args, skip_bad,
                       chat_template)  # fmt: skip
    _not_both(tuned, against, compare_logit)
    source = PromptSource.of(prompts)
    session = _joined(dist_backend, device, source, against, device_map)
    with nullcontext() if session is None else session.guarded():
        lens_dir = _tuned_folder(tuned)
        loads = (revision, dtype, device, device_map, max_memory, offload_folder, trust_remote_code)
        asked = (against, against_tokenizer, against_revision, threshold)
        loading, pair = _models(model, tokenizer, loads, *asked)
        return _many(model, tokenizer, (loading, pair), ask, source, each, lens_dir,
                     compare_logit, session, site)  # fmt: skip


def _many(
    model: object,
    tokenizer: Any,
    models: tuple[options.Load | dict[str, bool], Pair | None],
    ask: options.ManyAsk,
    source: PromptSource,
    each: EachFn | None,
    lens_dir: LensFolder | None,
    compare_logit: bool,
    session: Session | None,
    site: str | Sequence[str] | None = None,
) -> LensSummaryReport:
    """`lens_prompts` once what was asked is checked: every line checked before the model
    loads, then the run (`many.ManyRun`), split over the processes of `session`."""
    from embedlens.analysis.lens import many

    loading, pair = models
    sites = _sites(site, lens_dir, pair)
    if isinstance(loading, options.Load):
        many.check_file(source, ask)  # before the imports that loading brings in
    if pair is not None:
        from embedlens.analysis.lens.against import lens_pair_prompts

        return lens_pair_prompts(pair, ask, source, each)

    def check_lines(tok: Any, config: Any, template: str) -> tuple[int, list[Any]]:
        return many.check_all(source, ask, tok, config, template)

    check = _checked_with(lens_dir, check_lines)
    targets = functools.partial(many.check_targets, source, ask)
    with ready(model, tokenizer, loading, check, targets=targets) as (opened, (n_bad, bad)):
        through = _ready(lens_dir, opened)
        run = many.ManyRun(opened, ask, each, through, compare_logit=compare_logit)
        if sites != ("resid",):
            from embedlens.analysis.lens.site_many import SiteManyRun

            run = SiteManyRun(opened, ask, each, through).with_sites(sites)
        return run.all(source, n_bad, bad, session)


def _joined(
    backend: str,
    device: str,
    source: PromptSource,
    against: object,
    device_map: str | None,
) -> Session | None:
    """Under torchrun (WORLD_SIZE above 1): this process's part of the run, the process group
    joined, after what does not split is refused; None alone (`analysis.dist` unimported)."""
    from embedlens.runtime import world

    if world()[1] == 1:
        return None
    from embedlens.analysis import dist

    dist.check_backend(backend)
    what = None
    if against is not None:
        what = "--against (two models in turn, on one machine)"
    elif device_map is not None:
        what = "--device-map (one model over every device of the machine)"
    elif source.spool is not None:
        what = "prompts from stdin (the processes torchrun starts do not share it)"
    if what is not None:
        raise UsageError(
            f"under torchrun, lens --prompts runs the prompts split over processes: {what} "
            "runs in one process only",
            hint="run it without torchrun",
        )
    return dist.join(backend, device)


def _deprecated_many(
    model: str | os.PathLike[str] | nn.Module,
    prompt: str | None,
    prompts: Iterable[str | Mapping[str, Any]] | PromptSource | None,
    given: dict[str, Any],
) -> LensSummaryReport:
    """`lens(model, prompts=...)`, the former spelling of `lens_prompts`; `given`: every
    argument of that call, of which lens_prompts takes those it has too."""
    options.one_prompt_only(given["target"], given["chat"], given["grid"])
    if given.get("save_states") is not None:
        raise UsageError("save_states= writes the states of one prompt: give a prompt alone")
    taken = set(inspect.signature(lens_prompts).parameters) - {"model", "prompts"}
    many_options = {name: value for name, value in given.items() if name in taken}
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


Loads = tuple[
    str | None,
    str,
    str,
    str | None,
    Mapping[int | str, int | str] | str | None,
    str | os.PathLike[str] | None,
    bool,
]
"""revision, dtype, device, device_map, max_memory, offload_folder, trust_remote_code."""


def _models(
    model: object,
    tokenizer: Any,
    loads: Loads,
    against: object,
    against_tokenizer: Any,
    against_revision: str | None,
    threshold: float | None,
) -> tuple[options.Load | dict[str, bool], Pair | None]:
    """How to load the model (`_loading`), and with `against` the pair: B loads as A does, but
    for its revision (a loaded B refuses that alone)."""
    loading = _loading(model, *loads)
    limit = options.check_threshold(threshold, against)
    if against is None:
        if against_tokenizer is not None or against_revision is not None:
            raise UsageError("--against-revision and against_tokenizer apply only with --against")
        return loading, None
    from embedlens.analysis.lens.pairing import Pair, Side

    if isinstance(against, (str, os.PathLike)):
        b_loading = _loading(against, against_revision, *loads[1:])
    else:
        b_loading = options.loading_given(
            against_revision, "float32", "cpu", None, None, None, False
        )
    a, b = Side(model, tokenizer, loading), Side(against, against_tokenizer, b_loading)  # type: ignore[arg-type]
    return loading, Pair(a, b, limit)


def _sites(
    site: str | Sequence[str] | None, tuned: object, against_many: object = None
) -> tuple[str, ...]:
    """`site=` checked before any model loads: the sites asked for, in block order
    (`site_report.check_sites`; `against_many`: B, with many prompts)."""
    from embedlens.analysis.lens.site_report import parse_sites

    sites = parse_sites(site)
    check_sites(sites, tuned, against_many)
    return sites


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


def _not_both(tuned: object, against: object, compare_logit: bool = False) -> None:
    """--tuned and --against together are refused: a pair is compared through each model's own
    decoder, and one lens folder fits one model; --compare-logit needs --tuned."""
    if compare_logit and tuned is None:
        raise UsageError(
            "--compare-logit compares the tuned lens with the logit lens: give --tuned"
        )
    if tuned is not None and against is not None:
        raise UsageError(
            "--tuned and --against do not combine: --against compares two models through their "
            "own decoders (the logit lens); run --tuned on each model alone"
        )


def _tuned_decoder(through: Through | None, opened: Opened, run: Prompt) -> Decoder | None:
    """The tuned lens's decoder for one prompt, built on the model's own (None without one)."""
    if through is None:
        return None
    from embedlens.analysis.lens.blocks import find_blocks
    from embedlens.analysis.lens.decoder import ModelDecoder

    model = opened.model
    return through[0](ModelDecoder(model, find_blocks(model), dummy_id=run.ids[0]))


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
