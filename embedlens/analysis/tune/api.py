"""`tune`: fit a tuned lens to a model from Python, evaluate it on held-out text, write it.

What needs no model is checked first (`options`: counts, files, --out); the data are tokenised
and cut into sequences with the model's tokenizer before its weights load (`opening`, the lens's
one way to get a model ready). The lens folder appears at `out` only once complete.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Unpack

from embedlens.analysis.tune import options
from embedlens.analysis.tune.data import Plan, plan_sequences
from embedlens.errors import UsageError
from embedlens.options import LoadKeywords, LoadOptions, renamed

FORMAT_VERSION = 1
"""The version of the `embedlens` object of a lens folder's config.json."""

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase

    from embedlens.analysis.dist import Session
    from embedlens.analysis.lens.opening import Opened
    from embedlens.analysis.lens.tuned_folder import Identity
    from embedlens.analysis.tune.refine import Recipe
    from embedlens.analysis.tune.run import Fitted
    from embedlens.progress import Progress
    from embedlens.reports.tune import TuneReport


def tune(
    model: str | os.PathLike[str] | nn.Module | LoadOptions,
    data: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    eval_data: str | os.PathLike[str] | None = None,
    seq_len: int | None = None,
    tokens: int = options.TOKENS,
    eval_tokens: int = options.EVAL_TOKENS,
    refine_tokens: int | None = None,
    steps: int | None = None,
    lr: float | None = None,
    method: str = "kl",
    seed: int = 0,
    progress: Progress | None = None,
    load: LoadOptions | None = None,
    dist_backend: str = "auto",
    **keywords: Unpack[LoadKeywords],
) -> TuneReport:
    """Fit a tuned lens (an affine translator per layer, decoded by the model's own final norm
    and head) and write it to the folder `out`; the report holds its held-out evaluation.

    data: a UTF-8 text file (documents separated by blank lines) or JSON Lines with a `text`
        field, read as far as `tokens` (plus `eval_tokens` held out at its tail without
        `eval_data`, the held-out text's own file: --eval; formerly `eval`, deprecated).
    method: 'kl' (least squares, then tuned-lens's KL refinement on `refine_tokens` of the
        tokens fitted, in `steps` steps at learning rate `lr`) or 'affine' (least squares alone).
    seed: the refinement's order of rows: the same data and seed give the same lens.
    progress: `progress(stage, done, total, unit, detail)` (`Progress`): 'fitting' tokens,
        'solving' layers, 'checking' sequences (detail: which translators), 'refining' steps
        from 0 (detail: KL by bands of layers), then 'evaluating' held-out tokens.
    load: `LoadOptions` (or its fields as keywords, `dtype=`...); it loads on one device.
    dist_backend: under torchrun (WORLD_SIZE > 1), the process group's backend ('auto', 'gloo'
        or 'nccl'): each rank fits and evaluates every WORLD_SIZE-th sequence, the sums are
        added over ranks, each refinement step's rows are split between them and its gradients
        summed; rank 0 writes the folder, every rank returns the report.
    A loaded model (with its `tokenizer`) runs as it is.
    """
    from embedlens.analysis.lens import given
    from embedlens.analysis.torchrun import split_session
    from embedlens.progress import progress_of

    extra: dict[str, Any] = dict(keywords)
    eval_data = renamed("tune", extra, "eval", "eval_data", eval_data, _EVAL_NOW)
    model, load = given.model_and_load("tune", model, load, extra)
    shown = None if progress is None else progress_of(progress, "tune")
    session = split_session(dist_backend, load.device)
    with nullcontext() if session is None else session.guarded():
        ask = options.ask(data, out, eval_data, seq_len, tokens, eval_tokens,
                          (refine_tokens, steps, lr), method, seed)  # fmt: skip
        _one_device(load)
        loading = given.loading(model, load)

        def check(tok: Any, config: Any, _template: str) -> Plan:
            return plan(ask, tok, config)

        with _opened(model, tokenizer, loading, check) as (opened, the_plan):
            fitted = _run(opened, ask, the_plan, shown, session)
            return _write(opened, ask, the_plan, fitted, load.revision, session)


_EVAL_NOW = "the held-out text's file is now"
"""`tune(eval=)`'s deprecation: the words before `eval_data=`."""


def _one_device(load: LoadOptions) -> None:
    """tune loads the model on one device: what spreads it over several is refused."""
    spread = [name for name in ("device_map", "max_memory", "offload_folder")
              if getattr(load, name) is not None]  # fmt: skip
    if spread:
        raise UsageError(f"tune loads the model on one device: {', '.join(spread)} do not apply")


def plan(ask: options.TuneAsk, tokenizer: Any, config: Any) -> Plan:
    """The sequences the run needs, tokenised before the weights load (`plan_sequences`)."""
    counts = (ask.tokens, ask.eval_tokens, ask.refine_tokens)
    files = (ask.data, ask.eval_file)
    return plan_sequences(tokenizer, config, files, ask.seq_len, counts, ask.seed)


def _run(
    opened: Opened,
    ask: options.TuneAsk,
    the_plan: Plan,
    progress: Progress | None,
    session: Session | None,
) -> Fitted:
    """Fit, refine and evaluate on the model made ready (split over the processes of
    `session`)."""
    from embedlens.analysis.tune.run import tune_model

    recipe = _recipe(ask, the_plan) if ask.method == "kl" else None
    return tune_model(opened.model, the_plan, recipe, ask.seed, progress, session)


def _recipe(ask: options.TuneAsk, the_plan: Plan) -> Recipe:
    """The refinement's settings: the rows it reads, its steps (at most one per row)."""
    from embedlens.analysis.tune.refine import Recipe

    rows = the_plan.refine_rows
    return Recipe(rows=rows, steps=min(ask.steps, rows), lr=ask.lr)


def _write(
    opened: Opened,
    ask: options.TuneAsk,
    the_plan: Plan,
    fitted: Fitted,
    revision: str | None,
    session: Session | None,
) -> TuneReport:
    """The lens folder written (by rank 0 alone under torchrun), and the report."""
    from embedlens.analysis.lens.report import dtype_name
    from embedlens.analysis.lens.tuned_folder import identify
    from embedlens.analysis.tune.folder import write_folder
    from embedlens.reports.tune import TuneReport

    dtype = dtype_name(opened.model)
    identity = identify(opened.model, fitted.blocks, opened.tokenizer)
    ours = _recorded(ask, the_plan, fitted, identity, dtype)
    if session is None or session.rank == 0:
        write_folder(
            ask.out, fitted.translators, opened.name, revision, identity.unembed_hash, ours
        )
    notes = [*opened.before, *the_plan.notes, *opened.after]
    if session is not None:
        notes.append(
            f"split over {session.size} processes (torchrun, {session.backend}): sequence s "
            f"fitted and evaluated on rank s mod {session.size}, each refinement step's rows "
            "shared out and its gradients summed; rank 0 wrote the folder"
        )
    return TuneReport(
        model=opened.name,
        out=str(ask.out),
        method=ask.method,
        data=str(ask.data),
        seq_len=the_plan.seq_len,
        fit_tokens=the_plan.fit_tokens,
        refine_tokens=ours["refine_tokens"],
        steps=ours["steps"],
        refined_layers=None if fitted.refined is None else fitted.refined.refined_layers,
        lr=ask.lr,
        seed=ask.seed,
        eval=str(ask.eval_file) if ask.eval_file is not None else f"the tail of {ask.data}",
        eval_tokens=the_plan.eval_tokens,
        eval_bytes=the_plan.eval_bytes,
        num_layers=fitted.translators.num_layers,
        hidden_size=fitted.translators.width,
        dtype=dtype,
        layers=fitted.layers,
        notes=notes,
    )


def _recorded(
    ask: options.TuneAsk, the_plan: Plan, fitted: Fitted, identity: Identity, dtype: str
) -> dict[str, Any]:
    """config.json's `embedlens` object: what refuses the lens on another model, how it was
    tuned."""
    from embedlens.analysis.tune.run import RIDGE

    t = fitted.translators
    recipe = _recipe(ask, the_plan)
    return {
        "format": FORMAT_VERSION,
        "hidden_size": t.width,
        "num_layers": t.num_layers,
        "vocab_rows": fitted.vocab_rows,
        "tokenizer_size": identity.tokenizer_size,
        "decoder_fingerprint": identity.decoder_fingerprint,
        "vocab_fingerprint": identity.vocab_fingerprint,
        "dtype": dtype,
        "method": ask.method,
        "data": str(ask.data),
        "seq_len": the_plan.seq_len,
        "fit_tokens": the_plan.fit_tokens,
        "ridge": RIDGE,
        "refine_tokens": recipe.rows,
        "steps": recipe.steps,
        "refined_layers": None if fitted.refined is None else fitted.refined.refined_layers,
        "lr": ask.lr,
        "seed": ask.seed,
        "optimizer": {
            "name": "SGD", "nesterov": True, "momentum": recipe.momentum,
            "weight_decay": recipe.weight_decay, "clip_grad_norm": recipe.clip,
            "schedule": "linear decay to 0",
        } if ask.method == "kl" else None,
    }  # fmt: skip


@contextmanager
def _opened(
    model: object, tokenizer: Any, loading: Any, check: Any
) -> Iterator[tuple[Opened, Plan]]:
    """The model ready (from its files, or as the caller loaded it), with the plan checked
    before any weight was read."""
    from embedlens.analysis.lens import opening
    from embedlens.analysis.lens.options import Load

    if isinstance(loading, Load):
        assert isinstance(model, (str, os.PathLike))
        with opening.from_files(os.fspath(model), loading, tokenizer, check) as ready:
            yield ready
    else:
        assert isinstance(loading, Mapping)
        with opening.from_loaded(model, tokenizer, dict(loading), check) as ready:
            yield ready
