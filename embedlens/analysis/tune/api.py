"""`tune`: fit a tuned lens to a model from Python, evaluate it on held-out text, write it.

What needs no model is checked first (`options`: counts, files, --out); the data are tokenised
and cut into sequences with the model's tokenizer before its weights load (`opening`, the lens's
one way to get a model ready). The lens folder appears at `out` only once complete.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from embedlens.analysis.tune import options
from embedlens.analysis.tune.data import Sequences, read_sequences
from embedlens.errors import UsageError
from embedlens.options import LoadOptions, renamed

FORMAT_VERSION = 1
"""The version of the `embedlens` object of a lens folder's config.json."""

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase

    from embedlens.analysis.dist import Session
    from embedlens.analysis.lens.opening import Opened
    from embedlens.analysis.tune.run import Fitted
    from embedlens.progress import Progress
    from embedlens.reports.tune import TuneReport


@dataclass(frozen=True)
class Plan:
    """The data as run: sequences to fit, to refine on (a seeded share of those), to hold out."""

    seq_len: int
    fit: Sequences
    refine: Sequences
    check: Sequences
    """A fitted sequence the refinement does not read, to keep each refined translator only
    where it does better than its start."""
    held_out: Sequences
    notes: list[str]


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
    **keywords: Any,
) -> TuneReport:
    """Fit a tuned lens (an affine translator per layer, decoded by the model's own final norm
    and head) and write it to the folder `out`; the report holds its held-out evaluation.

    data: a UTF-8 text file (documents separated by blank lines) or JSON Lines with a `text`
        field, read as far as `tokens` (plus `eval_tokens` held out at its tail without
        `eval_data`, the held-out text's own file: --eval; formerly `eval`, deprecated).
    method: 'kl' (least squares, then tuned-lens's KL refinement on `refine_tokens` of the
        tokens fitted, in `steps` steps at learning rate `lr`) or 'affine' (least squares alone).
    seed: the refinement's order of rows: the same data and seed give the same lens.
    progress: called as `progress(stage, done, total, unit, detail)` as work advances
        (`embedlens.progress.Progress`): 'fitting' and 'evaluating' count tokens, 'refining'
        steps (the detail: the KL of bands of layers).
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

    eval_data = renamed("tune", keywords, "eval", "eval_data", eval_data, _EVAL_NOW)
    model, load = given.model_and_load("tune", model, load, keywords)
    shown = progress_of(progress, "tune")
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


CHECKED_TEXTS = 8
"""How many of the data's texts are checked against a GGUF file's own tokenizer: a release that
converts the file's tokenizer otherwise reads ordinary text otherwise from the first line."""


def plan(ask: options.TuneAsk, tokenizer: Any, config: Any) -> Plan:
    """Tokenise the data into the sequences the run needs (before the weights load); on a GGUF,
    the first texts' ids are checked against the file's own tokenizer."""
    from embedlens.model import file_tokens

    asked = ask.seq_len
    context = _context(config)
    seq_len, note = options.resolve_seq_len(asked, context, min(ask.tokens, ask.eval_tokens))
    sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id

    checked = [0]

    def tokenize(text: str) -> list[int]:
        ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
        if checked[0] < CHECKED_TEXTS:  # a GGUF's own reading of the first texts (file_tokens)
            checked[0] += 1
            file_tokens.check_ids(text, False, ids)
        return ids

    n_fit, n_eval = ask.tokens // seq_len, ask.eval_tokens // seq_len
    notes = [] if note is None else [note]
    if ask.eval_file is None:
        stream = read_sequences(ask.data, tokenize, sep, seq_len, n_fit + n_eval)
        fit, held_out = _split(stream, n_fit, n_eval, ask, notes)
    else:
        fit = read_sequences(ask.data, tokenize, sep, seq_len, n_fit)
        held_out = read_sequences(ask.eval_file, tokenize, sep, seq_len, n_eval, "--eval")
        for what, got, want in (("--data", fit, n_fit), ("--eval", held_out, n_eval)):
            _enough(what, got, want, seq_len, notes)
    refine, check = _refine_share(fit, ask)
    return Plan(seq_len, fit, refine, check, held_out, notes)


def _context(config: Any) -> int | None:
    """The model's context length in tokens, if its config gives one."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    context = getattr(text, "max_position_embeddings", None)
    return context if isinstance(context, int) and not isinstance(context, bool) else None


def _split(
    stream: Sequences, n_fit: int, n_eval: int, ask: options.TuneAsk, notes: list[str]
) -> tuple[Sequences, Sequences]:
    """The data's sequences fitted, and its tail held out (a tenth of it, at least one
    sequence, when the data hold fewer than asked)."""
    have = len(stream)
    if have < 2:
        raise UsageError(
            f"--data '{ask.data}' holds too little text: not one sequence of {stream.seq_len:,} "
            "tokens to fit and one to hold out",
            hint="give more text, a smaller --seq-len, or --eval FILE",
        )
    if have < n_fit + n_eval:
        n_eval = min(n_eval, max(1, have // 10))
        n_fit = have - n_eval
        notes.append(
            f"--data holds {have * stream.seq_len:,} tokens (in sequences of {stream.seq_len:,}), "
            f"fewer than --tokens and --eval-tokens ask: fitted on {n_fit * stream.seq_len:,}, "
            f"held out the last {n_eval * stream.seq_len:,}"
        )
    return stream.part(0, n_fit), stream.part(n_fit, n_fit + n_eval)


def _enough(what: str, got: Sequences, want: int, seq_len: int, notes: list[str]) -> None:
    if len(got) == 0:
        raise UsageError(
            f"{what} holds too little text: not one sequence of {seq_len:,} tokens",
            hint="give more text, or a smaller --seq-len",
        )
    if len(got) < want:
        notes.append(f"{what} holds only {got.tokens:,} tokens (in sequences of {seq_len:,})")


def _refine_share(fit: Sequences, ask: options.TuneAsk) -> tuple[Sequences, Sequences]:
    """The sequences the refinement reads (a seeded choice among those fitted), and the one it
    checks its translators on: the next in that order (with a single sequence, that one)."""
    if ask.refine_tokens == 0:
        return fit.part(0, 0), fit.part(0, 0)
    order = list(range(len(fit)))
    random.Random(ask.seed).shuffle(order)
    count = min(len(fit), -(-ask.refine_tokens // fit.seq_len))
    chosen, check = Sequences(fit.seq_len), Sequences(fit.seq_len)
    for i in order[:count]:
        chosen.add(fit.ids[i], fit.text_tokens[i], fit.text_bytes[i])
    i = order[count] if count < len(order) else order[-1]
    check.add(fit.ids[i], fit.text_tokens[i], fit.text_bytes[i])
    return chosen, check


def _run(
    opened: Opened,
    ask: options.TuneAsk,
    the_plan: Plan,
    progress: Progress | None,
    session: Session | None,
) -> Fitted:
    """Fit, refine and evaluate on the model made ready (split over the processes of
    `session`)."""
    from embedlens.analysis.tune.refine import Recipe
    from embedlens.analysis.tune.run import Fitted, Tuning

    run = Tuning(opened.model, progress, session)
    translators = run.fit(the_plan.fit)
    refined = None
    if ask.method == "kl":
        rows = min(ask.refine_tokens, the_plan.refine.tokens)
        recipe = Recipe(rows=rows, steps=min(ask.steps, rows), lr=ask.lr)
        refined = run.refine(translators, the_plan.refine, the_plan.check, recipe, ask.seed)
        translators = refined.translators
    layers = run.evaluate(translators, the_plan.held_out)
    return Fitted(translators, layers, run.vocab_rows, refined)


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
    from embedlens.analysis.tune.folder import lens_config, write_folder
    from embedlens.reports.tune import TuneReport

    ours = _recorded(opened, ask, the_plan, fitted)
    from embedlens.analysis.tune.match import unembed_hash

    unembed = unembed_hash(opened.model)
    config = lens_config(opened.name, revision, unembed, fitted.translators, ours)
    if session is None or session.rank == 0:
        write_folder(ask.out, fitted.translators, config)
    held = the_plan.held_out
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
        fit_tokens=the_plan.fit.tokens,
        refine_tokens=ours["refine_tokens"],
        steps=ours["steps"],
        refined_layers=None if fitted.refined is None else fitted.refined.refined_layers,
        lr=ask.lr,
        seed=ask.seed,
        eval=str(ask.eval_file) if ask.eval_file is not None else f"the tail of {ask.data}",
        eval_tokens=held.tokens,
        eval_bytes=sum(held.text_bytes),
        num_layers=fitted.translators.num_layers,
        hidden_size=fitted.translators.width,
        dtype=dtype_name(opened.model),
        layers=fitted.layers,
        notes=notes,
    )


def _recorded(
    opened: Opened, ask: options.TuneAsk, the_plan: Plan, fitted: Fitted
) -> dict[str, Any]:
    """config.json's `embedlens` object: what refuses the lens on another model, how it was
    tuned."""
    from embedlens.analysis.lens.report import dtype_name
    from embedlens.analysis.tune import match
    from embedlens.analysis.tune.fit import RIDGE
    from embedlens.analysis.tune.refine import Recipe

    model, t = opened.model, fitted.translators
    refine_tokens = min(ask.refine_tokens, the_plan.refine.tokens)
    recipe = Recipe(rows=refine_tokens, steps=min(ask.steps, refine_tokens), lr=ask.lr)
    return {
        "format": FORMAT_VERSION,
        "hidden_size": t.width,
        "num_layers": t.num_layers,
        "vocab_rows": fitted.vocab_rows,
        "tokenizer_size": len(opened.tokenizer),
        "decoder_fingerprint": match.decoder_fingerprint(model),
        "vocab_fingerprint": match.vocab_fingerprint(opened.tokenizer),
        "dtype": dtype_name(model),
        "method": ask.method,
        "data": str(ask.data),
        "seq_len": the_plan.seq_len,
        "fit_tokens": the_plan.fit.tokens,
        "ridge": RIDGE,
        "refine_tokens": refine_tokens,
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
