"""`lens` and `lens_prompts`: the logit lens from Python, on one prompt or many.

Each makes what it is given into its option objects (`embedlens.options.lens_given`: keyword
arguments build the `LoadOptions` and `LensOptions`; a field given both as a keyword and in
`load=`/`options=` is refused, as is a keyword neither object has), checks them before any file
is read (`options.ask`, `options.many`, `models`), gets the model ready one way (`opening`),
runs the engine, and builds the report. A model given already loaded is used as it is: never
reloaded, moved, re-typed or left changed.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Iterable, Mapping
from contextlib import nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar, Unpack, overload

from embedlens.analysis.lens import many
from embedlens.analysis.lens import options as checks
from embedlens.analysis.lens.against import lens_pair, lens_pair_prompts
from embedlens.analysis.lens.many import OnReport, run_one
from embedlens.analysis.lens.opening import make_prompt, open_model
from embedlens.analysis.lens.pairing import Pair, Side
from embedlens.analysis.lens.report import one_report
from embedlens.analysis.lens.site_report import SiteManyRun, sites_report
from embedlens.analysis.lens.states_file import ManySaver, save_run, saving_many
from embedlens.analysis.lens.tuned_folder import fits_tuned, open_learned
from embedlens.errors import UsageError
from embedlens.options import LensKeywords, LensOptions, LoadOptions, lens_given, renamed

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase

    from embedlens.analysis.dist import Session
    from embedlens.analysis.lens.opening import Check
    from embedlens.analysis.lens.tuned_folder import Learned
    from embedlens.model.prompts import PromptSource
    from embedlens.progress import Progress
    from embedlens.reports.lens import LensReport, LensSummaryReport

T = TypeVar("T")


@overload
def lens(
    model: str | os.PathLike[str] | nn.Module | LoadOptions,
    prompt: str,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    load: LoadOptions | None = None,
    options: LensOptions | None = None,
    against: str | os.PathLike[str] | nn.Module | None = None,
    against_tokenizer: PreTrainedTokenizerBase | None = None,
    against_revision: str | None = None,
    save_states: str | os.PathLike[str] | None = None,
    **keywords: Unpack[LensKeywords],
) -> LensReport: ...


@overload
def lens(
    model: str | os.PathLike[str] | nn.Module | LoadOptions,
    prompt: None = None,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    load: LoadOptions | None = None,
    options: LensOptions | None = None,
    against: str | os.PathLike[str] | nn.Module | None = None,
    against_tokenizer: PreTrainedTokenizerBase | None = None,
    against_revision: str | None = None,
    prompts: Iterable[str | Mapping[str, Any]] | PromptSource,
    **keywords: Unpack[LensKeywords],
) -> LensSummaryReport: ...


def lens(
    model: str | os.PathLike[str] | nn.Module | LoadOptions,
    prompt: str | None = None,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    load: LoadOptions | None = None,
    options: LensOptions | None = None,
    against: str | os.PathLike[str] | nn.Module | None = None,
    against_tokenizer: PreTrainedTokenizerBase | None = None,
    against_revision: str | None = None,
    save_states: str | os.PathLike[str] | None = None,
    prompts: Iterable[str | Mapping[str, Any]] | PromptSource | None = None,
    **keywords: Unpack[LensKeywords],
) -> LensReport | LensSummaryReport:
    """Decode every layer's residual stream with the model's own final norm, head and post-head
    steps; the report's `check` says whether that reproduces the model's logits.

    model: a hub id, a folder, a .gguf file, a `LoadOptions` naming one (its `source`), or a
        loaded transformers model (then `tokenizer` is required, and the loading options must
        stay at their defaults: it runs as it is).
    load: how to load the model (`LoadOptions`); options: what the lens is asked
        (`LensOptions`). Each field of either may be given as a keyword instead (`layers=`,
        `dtype=`, ...); a field given both ways is refused.
    against: B, read on the same ids and loaded as `model` (but `against_revision`); the report's
        `diff` then says where B parts from A (`threshold`: nats).
    save_states: a file for every layer's residual stream at every position (`lens_states`).
    site: 'resid' (default), 'resid_mid', 'attn_out', 'mlp_out' or several: docs/lens.md.
    Many prompts: `lens_prompts` (`lens(model, prompts=...)` calls it, deprecated).
    """
    if prompts is not None or prompt is None:
        return _deprecated_many(model, prompt, prompts, locals())
    model, load, asked = lens_given("lens", model, load, options, dict(keywords))
    ask = checks.ask(prompt, asked)
    b = (against, against_tokenizer, against_revision, asked.threshold)
    loading, pair = models(model, tokenizer, load, *b)
    if save_states is not None and pair is not None:
        raise UsageError("--save-states and --against do not combine: save each model's alone")
    lens_dir = open_learned(asked.tuned, asked.jacobian)
    if pair is not None:
        return lens_pair(pair, ask, lens_dir)
    save = None if save_states is None else (save_states, load.revision)
    return _one_prompt(model, tokenizer, loading, ask, lens_dir, save)


def _one_prompt(
    model: object,
    tokenizer: Any,
    loading: checks.Loading,
    ask: checks.Ask,
    lens_dir: Learned | None,
    save: tuple[str | os.PathLike[str], str | None] | None,
) -> LensReport:
    """One prompt through the engine (through a tuned lens, `lens_dir`), and its report (with
    the sites inside the blocks, `ask.sites`; `save`: where --save-states writes, and the
    revision its metadata names)."""
    check = _checked_with(lens_dir, functools.partial(make_prompt, ask))
    own_template = ask.chat is not None and ask.template is None
    texts = () if ask.chat is not None else (ask.prompt,)
    ready = open_model(model, tokenizer, loading, check, own_template, ask.target, texts=texts)
    with ready as (opened, run):
        from embedlens.analysis.lens.decoders import tuned_through

        through = tuned_through(lens_dir, opened.model, opened.tokenizer)
        decoder = None if through is None else through.decoder(opened.model, run.ids[0])
        result = run_one(opened, ask, run, decoder=decoder)
        base = one_report(opened, ask, run, result)
        report = sites_report(base, opened, ask, run, result)
        if save is not None:
            save_run(save[0], opened, run, ask, save[1])
        if through is None:
            return report
        return replace(report, **through.fields)


def lens_prompts(
    model: str | os.PathLike[str] | nn.Module | LoadOptions,
    prompts: Iterable[str | Mapping[str, Any]] | PromptSource,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    load: LoadOptions | None = None,
    options: LensOptions | None = None,
    on_report: OnReport | None = None,
    progress: Progress | None = None,
    against: str | os.PathLike[str] | nn.Module | None = None,
    against_tokenizer: PreTrainedTokenizerBase | None = None,
    against_revision: str | None = None,
    dist_backend: str = "auto",
    save_states: str | os.PathLike[str] | None = None,
    **keywords: Unpack[LensKeywords],
) -> LensSummaryReport:
    """The lens over many prompts, the model loaded once: per-layer statistics (KL from the
    model's output, entropy, top-1 agreement, the target's probability and rank).

    prompts: strings, or dicts with `prompt` and optional `target`, `chat` (a user message) and
        `id`; or `PromptSource.open(path)` (a file of one prompt per line or JSON Lines).
    options: `LensOptions` (or its fields as keywords): `position` may be a list of positions
        read in every prompt; `skip_bad` skips (and counts) bad prompts instead of stopping at
        the first; `compare_logit`, with `tuned`: the logit lens's statistics over the same
        prompts too (the summary's `logit_layers`). `target`, `chat` and `grid` are each line's.
    on_report: called as `on_report(report, line)` with each prompt's `LensReport` (what `lens`
        returns for it) as it comes (formerly `each`, deprecated).
    progress: called as `progress("prompts", done, 0, "prompts")` after each window of prompts
        (`embedlens.progress.Progress`).
    against: B (`against_tokenizer`: a loaded B's own, else A's is used); the summary then
        has its `diff`, and `on_report` is given each prompt's report with its own (with `site`:
        the report `lens` gives, the summary comparing the sites too).
    dist_backend: under torchrun (WORLD_SIZE > 1), the process group's backend ('auto', 'gloo'
        or 'nccl'): window w of the prompts runs on rank w mod WORLD_SIZE, `on_report` is called
        on rank 0 with every prompt's report in input order, every rank returns the summary.
    The other arguments are `lens`'s (`site`: statistics per layer and site).
    """
    from embedlens.analysis import torchrun
    from embedlens.model.prompts import PromptSource
    from embedlens.progress import progress_of

    extra: dict[str, Any] = dict(keywords)
    on_report = renamed("lens_prompts", extra, "each", "on_report", on_report,
                        "the callback is now named")  # fmt: skip
    model, load, asked = lens_given("lens_prompts", model, load, options, extra)
    ask = checks.many(asked, against)
    source = PromptSource.of(prompts)
    session = torchrun.lens_session(dist_backend, load, source, against)
    with nullcontext() if session is None else session.guarded():
        lens_dir = open_learned(asked.tuned, asked.jacobian)
        b = (against, against_tokenizer, against_revision, asked.threshold)
        loading, pair = models(model, tokenizer, load, *b)
        run = (on_report, progress_of(progress, "lens_prompts"), asked.compare_logit)
        saving = saving_many(save_states, load.revision, against, session)
        return _many(model, tokenizer, loading, pair, ask, source, run, lens_dir, session, saving)


def _many(
    model: object,
    tokenizer: Any,
    loading: checks.Loading,
    pair: Pair | None,
    ask: checks.ManyAsk,
    source: PromptSource,
    run: tuple[OnReport | None, Progress, bool],
    lens_dir: Learned | None,
    session: Session | None,
    saving: tuple[str | os.PathLike[str], str | None] | None,
) -> LensSummaryReport:
    """`lens_prompts` once what was asked is checked: every line checked before the model
    loads, then the run (`many.ManyRun`), split over the processes of `session`."""
    on_report, progress, compare_logit = run
    sites = ask.sites
    if isinstance(loading, checks.Load):
        many.check_file(source, ask)  # before the imports that loading brings in
    if pair is not None:
        return lens_pair_prompts(pair, ask, source, on_report, lens_dir)

    check = _checked_with(lens_dir, functools.partial(many.check_all, source, ask))
    targets = functools.partial(many.check_targets, source, ask)
    texts = many.plain_texts(source)
    ready = open_model(model, tokenizer, loading, check, targets=targets, texts=texts)
    with ready as (opened, (n_bad, bad)):
        from embedlens.analysis.lens.decoders import tuned_through

        through = tuned_through(lens_dir, opened.model, opened.tokenizer)
        lensing = many.ManyRun(opened, ask, on_report, through, compare_logit=compare_logit)
        if sites != ("resid",):
            lensing = SiteManyRun(opened, ask, on_report, through)
        if saving is not None:
            lensing.saver = ManySaver(saving[0], opened, saving[1], sites)
        return lensing.run_all(source, n_bad, bad, session, progress)


def _checked_with(lens_dir: Learned | None, check: Check[T]) -> Check[T]:
    """`check`, after the tuned lens's size is checked against the model's config (`check`
    itself without a lens: the walk from opening to it stays in opening)."""
    if lens_dir is None:
        return check

    def both(tok: Any, config: Any, template: str) -> T:
        fits_tuned(lens_dir, config)
        return check(tok, config, template)

    return both


def _deprecated_many(
    model: str | os.PathLike[str] | nn.Module | LoadOptions,
    prompt: str | None,
    prompts: Iterable[str | Mapping[str, Any]] | PromptSource | None,
    args: dict[str, Any],
) -> LensSummaryReport:
    """`lens(model, prompts=...)`, the former spelling of `lens_prompts`; `args`: every
    argument of that call, of which lens_prompts takes those it has too."""
    if args["save_states"] is not None:
        raise UsageError("save_states= writes the states of one prompt: give a prompt alone")
    if prompts is None:
        raise UsageError("give a prompt, or many with lens_prompts(model, prompts)")
    if prompt is not None:
        raise UsageError("give either a prompt or prompts=, not both")
    warnings.warn(
        "lens(model, prompts=...) is deprecated: use lens_prompts(model, prompts, ...)",
        DeprecationWarning,
        stacklevel=3,
    )
    both = ("tokenizer", "load", "options", "against", "against_tokenizer", "against_revision")
    return lens_prompts(model, prompts, **{name: args[name] for name in both}, **args["keywords"])


def models(
    model: object,
    tokenizer: Any,
    load: LoadOptions,
    against: object,
    against_tokenizer: Any,
    against_revision: str | None,
    threshold: float | None,
) -> tuple[checks.Loading, Pair | None]:
    """How to load the model (`loading`), and with `against` the pair: B loads as A does, but
    for its revision (a loaded B refuses that alone)."""
    a_loading = checks.loading(model, load)
    limit = _threshold(threshold, against)
    if against is None:
        if against_tokenizer is not None or against_revision is not None:
            raise UsageError("--against-revision and against_tokenizer apply only with --against")
        return a_loading, None
    if isinstance(against, (str, os.PathLike)):
        b_loading = checks.loading(against, replace(load, source=None, revision=against_revision))
    else:
        b_loading = LoadOptions(revision=against_revision).given()
    a, b = Side(model, tokenizer, a_loading), Side(against, against_tokenizer, b_loading)  # type: ignore[arg-type]
    return a_loading, Pair(a, b, limit)


def _threshold(threshold: float | None, against: object) -> float:
    """The KL (nats) above which a layer counts as divergent: DEFAULT_THRESHOLD, or the one
    given (with another model only; a number, at least 0)."""
    if threshold is None:
        return checks.DEFAULT_THRESHOLD
    if against is None:
        raise UsageError("--threshold applies only with --against")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise UsageError(f"--threshold must be a number of nats, not {threshold!r}")
    if not threshold >= 0 or threshold == float("inf"):
        raise UsageError(
            f"--threshold must be a finite number of nats, at least 0, not {threshold}"
        )
    return float(threshold)
