"""`tune`: fit a tuned lens to a model from Python, evaluate it on held-out text, write it.

What needs no model is checked first (`ask`: the data and held-out files, the output folder, the
token counts, the refinement's steps and learning rate); the data are tokenised and cut into
sequences with the model's tokenizer before its weights load (`opening`, the lens's one way to get
a model ready). The lens folder appears at `out` only once complete, written whole or not at all
(`write_folder`; `analysis/lens/tuned_folder.py` reads it and says what its config.json and
params.safetensors hold).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Unpack

from embedlens.analysis.lens.tuned_folder import CONFIG, LENS_TYPE, PARAMS
from embedlens.analysis.tune.data import Plan, check_file, plan_sequences
from embedlens.analysis.tune.jacobian_tune import JacobianAsk, JacobianRun, check_plan, jacobian_ask
from embedlens.errors import UsageError
from embedlens.options import LoadKeywords, LoadOptions, model_and_load, renamed

FORMAT_VERSION = 1
"""The version of the `embedlens` object of a lens folder's config.json."""

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase

    from embedlens.analysis.dist import Session
    from embedlens.analysis.lens.decoders import Translators
    from embedlens.analysis.lens.jacobian import Transport
    from embedlens.analysis.lens.opening import Opened
    from embedlens.analysis.lens.tuned_folder import Identity
    from embedlens.analysis.tune.refine import Recipe
    from embedlens.analysis.tune.run import Fitted
    from embedlens.progress import Progress
    from embedlens.reports.tune import TuneReport


METHODS = ("kl", "affine")
"""kl: least squares, then the KL refinement (tuned-lens's objective); affine: least squares."""
TOKENS = 40_000
EVAL_TOKENS = 2_048
REFINE_TOKENS = 2_048
ROWS_PER_STEP = 128
"""The refinement's default steps: its tokens / ROWS_PER_STEP."""
LR = 0.3
"""The refinement's default learning rate (tuned-lens's lr scale; its default, 1.0, is for
hundreds of steps of 2^18 tokens from the identity: from the least-squares start, with 128 rows a
step, it overshoots the last layers, which start close to their best. On SmolLM2, 2,048 tokens in
16 steps: mean held-out KL over layers 1.693 nats after least squares, 1.509 refined at 1.0 and
1.502 at 0.3, where every layer but the last improved)."""


@dataclass(frozen=True)
class TuneAsk:
    """What tune is asked for, checked."""

    data: Path
    out: Path
    eval_file: Path | None
    seq_len: int | None
    """None: `data.SEQ_LEN`, or the model's context when shorter."""
    tokens: int
    eval_tokens: int
    refine_tokens: int
    steps: int
    lr: float
    method: str
    seed: int
    jacobian: JacobianAsk | None = None
    """With --jacobian: the Jacobian lens's options."""


def tune_ask(
    data: str | os.PathLike[str],
    out: str | os.PathLike[str],
    eval_file: str | os.PathLike[str] | None,
    seq_len: int | None,
    tokens: int,
    eval_tokens: int,
    refine: tuple[int | None, int | None, float | None],
    method: str,
    seed: int,
) -> TuneAsk:
    """Check everything that needs no model: counts, the method, the files, --out."""
    if method not in METHODS:
        raise UsageError(f"unknown --method {method!r}", hint="use one of: " + ", ".join(METHODS))
    for name, value in (("--tokens", tokens), ("--eval-tokens", eval_tokens)):
        _positive(name, value)
    if seq_len is not None and (_integer(seq_len) is None or seq_len < 2):
        raise UsageError(f"--seq-len must be at least 2, not {seq_len!r}")
    for name, value in (("--tokens", tokens), ("--eval-tokens", eval_tokens)):
        if seq_len is not None and seq_len > value:
            raise UsageError(
                f"--seq-len {seq_len:,} is more than {name} ({value:,}): sequences are whole",
                hint=f"give a --seq-len of at most {value:,}, or more {name}",
            )
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise UsageError(f"--seed must be a non-negative integer, not {seed!r}")
    refine_tokens, steps, lr = _refinement(method, *refine, tokens)
    data_path = Path(data)
    eval_path = None if eval_file is None else Path(eval_file)
    check_file(data_path, tokens + (eval_tokens if eval_path is None else 0))
    if eval_path is not None:
        check_file(eval_path, eval_tokens, "--eval")
    out_path = Path(out)
    check_out(out_path)
    return TuneAsk(data_path, out_path, eval_path, seq_len, tokens, eval_tokens, refine_tokens,
                   steps, lr, method, seed)  # fmt: skip


def _refinement(
    method: str, tokens: int | None, steps: int | None, lr: float | None, fit: int
) -> tuple[int, int, float]:
    """(tokens, steps, lr) of the refinement: none with --method affine, which refuses them."""
    if method == "affine":
        given = [n for n, v in (("--refine-tokens", tokens), ("--steps", steps), ("--lr", lr))
                 if v is not None]  # fmt: skip
        if given:
            raise UsageError(
                f"{', '.join(given)} apply to the refinement: --method affine has none",
                hint="leave them out, or use --method kl",
            )
        return 0, 0, 0.0
    refine = REFINE_TOKENS if tokens is None else _positive("--refine-tokens", tokens)
    refine = min(refine, fit) if tokens is None else refine
    if refine > fit:
        raise UsageError(
            f"--refine-tokens {refine:,} is more than the tokens fitted (--tokens {fit:,}): the "
            "refinement reads a share of them"
        )
    n_steps = max(1, refine // ROWS_PER_STEP) if steps is None else _positive("--steps", steps)
    rate = LR if lr is None else lr
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < math.inf:
        raise UsageError(f"--lr must be a positive number, not {lr!r}")
    return refine, n_steps, float(rate)


def _integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _positive(name: str, value: Any) -> int:
    if _integer(value) is None or value < 1:
        raise UsageError(f"{name} must be a positive integer, not {value!r}")
    return int(value)


def tune(
    model: str | os.PathLike[str] | nn.Module | LoadOptions,
    data: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    eval_data: str | os.PathLike[str] | None = None,
    seq_len: int | None = None,
    tokens: int = TOKENS,
    eval_tokens: int = EVAL_TOKENS,
    refine_tokens: int | None = None,
    steps: int | None = None,
    lr: float | None = None,
    method: str = "kl",
    seed: int = 0,
    jacobian: bool = False,
    estimator: str | None = None,
    probes: int | None = None,
    skip_first: int | None = None,
    jacobian_tokens: int | None = None,
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
    jacobian: also fit the Jacobian lens (its `estimator`, `probes`, `skip_first` and
        `jacobian_tokens`: docs/tune.md), written to OUT/jacobian_lens.pt and evaluated too.
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
    from embedlens.analysis.torchrun import split_session
    from embedlens.progress import progress_of

    extra: dict[str, Any] = dict(keywords)
    eval_data = renamed("tune", extra, "eval", "eval_data", eval_data, _EVAL_NOW)
    model, load = model_and_load("tune", model, load, extra)
    shown = None if progress is None else progress_of(progress, "tune")
    session = split_session(dist_backend, load.device)
    with nullcontext() if session is None else session.guarded():
        ask = tune_ask(data, out, eval_data, seq_len, tokens, eval_tokens,
                       (refine_tokens, steps, lr), method, seed)  # fmt: skip
        given = (jacobian, estimator, probes, skip_first, jacobian_tokens)
        ask = dataclasses.replace(ask, jacobian=jacobian_ask(*given, split=session is not None))
        return _tune_checked(model, tokenizer, load, ask, shown, session)


def _tune_checked(
    model: Any,
    tokenizer: Any,
    load: LoadOptions,
    ask: TuneAsk,
    shown: Progress | None,
    session: Session | None,
) -> TuneReport:
    """`tune` once what needs no model is checked: the model opened, the lens(es) fitted, written."""
    from embedlens.analysis.lens.options import loading as checked_loading

    _one_device(load)
    loading = checked_loading(model, load)

    def check(tok: Any, config: Any, _template: str) -> Plan:
        return plan(ask, tok, config)

    j_ask = ask.jacobian
    with (
        _opened(model, tokenizer, loading, check) as (opened, the_plan),
        nullcontext(None) if j_ask is None else _beside(ask.out) as tmp,
    ):
        j_run = None if j_ask is None or tmp is None else JacobianRun(j_ask, tmp, opened.name)
        fitted = _run(opened, ask, the_plan, shown, session, j_run)
        return _write(opened, ask, the_plan, fitted, load.revision, session, j_run)


_EVAL_NOW = "the held-out text's file is now"
"""`tune(eval=)`'s deprecation: the words before `eval_data=`."""


def _one_device(load: LoadOptions) -> None:
    """tune loads the model on one device: what spreads it over several is refused."""
    spread = [name for name in ("device_map", "max_memory", "offload_folder")
              if getattr(load, name) is not None]  # fmt: skip
    if spread:
        raise UsageError(f"tune loads the model on one device: {', '.join(spread)} do not apply")


def plan(ask: TuneAsk, tokenizer: Any, config: Any) -> Plan:
    """The sequences the run needs, tokenised before the weights load (`plan_sequences`)."""
    counts = (ask.tokens, ask.eval_tokens, ask.refine_tokens)
    files = (ask.data, ask.eval_file)
    planned = plan_sequences(tokenizer, config, files, ask.seq_len, counts, ask.seed)
    if ask.jacobian is not None:
        check_plan(ask.jacobian, planned)
    return planned


def _run(
    opened: Opened,
    ask: TuneAsk,
    the_plan: Plan,
    progress: Progress | None,
    session: Session | None,
    j_run: JacobianRun | None = None,
) -> Fitted:
    """Fit, refine and evaluate on the model made ready (split over the processes of
    `session`); with `j_run`, the Jacobian lens fitted and evaluated too."""
    from embedlens.analysis.tune.jacobian_tune import sequences
    from embedlens.analysis.tune.run import tune_model

    recipe = _recipe(ask, the_plan) if ask.method == "kl" else None
    fit_j = None
    if j_run is not None:
        ids = sequences(j_run.ask, the_plan)

        def fit_j(model: nn.Module) -> Transport:
            return j_run.fit(model, ids, progress)

    return tune_model(opened.model, the_plan, recipe, ask.seed, progress, session, fit_j)


def _recipe(ask: TuneAsk, the_plan: Plan) -> Recipe:
    """The refinement's settings: the rows it reads, its steps (at most one per row)."""
    from embedlens.analysis.tune.refine import Recipe

    rows = the_plan.refine_rows
    return Recipe(rows=rows, steps=min(ask.steps, rows), lr=ask.lr)


def _write(
    opened: Opened,
    ask: TuneAsk,
    the_plan: Plan,
    fitted: Fitted,
    revision: str | None,
    session: Session | None,
    j_run: JacobianRun | None = None,
) -> TuneReport:
    """The lens folder written (by rank 0 alone under torchrun; with the Jacobian lens's
    artifact of `j_run`), and the report."""
    from embedlens.analysis.lens.report import dtype_name
    from embedlens.analysis.lens.tuned_folder import identify
    from embedlens.reports.tune import TuneReport

    dtype = dtype_name(opened.model)
    identity = identify(opened.model, fitted.blocks, opened.tokenizer)
    ours = _recorded(ask, the_plan, fitted, identity, dtype)
    if session is None or session.rank == 0:
        extra = [] if j_run is None or j_run.path is None else [j_run.path]
        write_folder(
            ask.out, fitted.translators, opened.name, revision, identity.unembed_hash, ours,
            extra,
        )  # fmt: skip
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
        jacobian=None if j_run is None else j_run.report(ask.out),
    )


def _recorded(
    ask: TuneAsk, the_plan: Plan, fitted: Fitted, identity: Identity, dtype: str
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


# --- the lens folder, written whole or not at all ---


def lens_config(
    base_model: str,
    revision: str | None,
    unembed_hash: str | None,
    translators: Translators,
    ours: dict[str, Any],
) -> dict[str, Any]:
    """config.json: tuned-lens's `TunedLensConfig` keys, in its order, then embedlens' own."""
    return {
        "base_model_name_or_path": base_model,
        "d_model": translators.width,
        "num_hidden_layers": translators.num_layers,
        "bias": True,
        "base_model_revision": revision,
        "unembed_hash": unembed_hash,
        "lens_type": LENS_TYPE,
        "embedlens": ours,
    }


def write_folder(
    out: Path,
    translators: Translators,
    base_model: str,
    revision: str | None,
    unembed_hash: str | None,
    ours: dict[str, Any],
    extra: list[Path] | None = None,
) -> None:
    """Write the lens to `out` whole or not at all (its config.json: `lens_config`; the files
    `extra` moved in beside it): into a temporary folder beside it, renamed to `out` once
    complete (an interrupted run leaves nothing at `out`)."""
    from safetensors.torch import save_file

    config = lens_config(base_model, revision, unembed_hash, translators, ours)
    tensors = {}
    for i in range(translators.num_layers):
        tensors[f"{i}.weight"] = translators.weight[i].contiguous()
        tensors[f"{i}.bias"] = translators.bias[i].contiguous()
    with _beside(out) as tmp:
        save_file(tensors, str(tmp / PARAMS), metadata={"format": "pt"})
        text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        (tmp / CONFIG).write_text(text, encoding="utf-8")
        for path in extra or []:
            os.replace(path, tmp / path.name)
        _usual_modes(tmp)
        os.rename(tmp, out)


def _usual_modes(folder: Path) -> None:
    """The modes a folder and files made by hand get (the umask's), not a temporary folder's
    private ones."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


@contextmanager
def _beside(out: Path) -> Iterator[Path]:
    """A temporary folder in `out`'s parent, removed unless it was renamed away."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def check_out(out: Path) -> None:
    """--out names a folder to create (or an empty one to fill) in a folder that can be
    written; checked before any work (UsageError if not)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "is a file" if not out.is_dir() else "already exists and is not empty"
        raise UsageError(
            f"--out '{out}' {what}", hint="name a new folder (the lens is written there whole)"
        )
    parent = out.parent
    if not parent.is_dir():
        raise UsageError(f"--out '{out}': its folder '{parent}' does not exist")
    try:
        with _beside(out):
            pass
    except OSError as e:
        raise UsageError(f"--out '{out}': cannot write in '{parent}': {e.strerror or e}") from None
