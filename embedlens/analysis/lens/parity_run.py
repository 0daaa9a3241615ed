"""`lens_parity`: the two sides of a parity run made into `parity.Stack`s and compared.

A side is a states file (or a folder of them, a file per sequence: `Files`) or a model run here
in a dtype (`Live`). The sequences come from the states side's files (their ids), else from the
input: a prompt, a prompts file, or a text's windows (its scored positions). A live B runs every
sequence first and is freed before A's weights are read; each side decodes through the tail its
model has (final norm and head, read alone, in --head-dtype or the side's dtype).
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Unpack

from embedlens.analysis.lens.parity import CAP, THRESHOLD, Stack, Tails, Tally, first_above
from embedlens.analysis.lens.parity_sources import (
    Files,
    Input,
    Seq,
    TextAsk,
    check_files,
    file_stack,
    held,
    live_stacks,
    open_files,
    paired,
    sequences,
    span,
)
from embedlens.errors import UsageError
from embedlens.options import LensKeywords
from embedlens.options import LensOptions as LensOptionsDefault

if TYPE_CHECKING:
    from embedlens.analysis.dist import Session
    from embedlens.analysis.lens.parity_sources import Held
    from embedlens.model.prompts import PromptSource
    from embedlens.options import LensOptions, LoadOptions
    from embedlens.reports.lens_parity import LensParityReport, ParitySide


@dataclass(frozen=True)
class Ask:
    """A parity run, its options checked: each side a states path or a model and its dtype."""

    model: str
    load: LoadOptions
    asked: LensOptions
    states: str | os.PathLike[str] | None
    against_states: str | os.PathLike[str] | None
    against: str
    against_dtype: str
    against_revision: str | None
    head_dtype: str | None
    state_layers: str | None
    cap: float
    inp: Input
    dist_backend: str = "auto"
    sites: tuple[str, ...] = ()
    """--site: the sites inside the blocks compared besides the residual stream."""


def lens_parity_run(ask: Ask) -> LensParityReport:
    """The run: sides opened and checked, sequences made, B's run first, then A's compared
    (under torchrun, sequence i on rank i mod N, every rank's figures gathered in order)."""
    from embedlens.analysis.lens.options import layer_items, resolve_layers
    from embedlens.io.source import resolve
    from embedlens.model import loading
    from embedlens.model.files import check_source

    source = resolve(ask.model, ask.load.revision)
    files = check_source(source, trust_remote_code=ask.load.trust_remote_code)
    tokenizer = loading.load_tokenizer(files, trust_remote_code=ask.load.trust_remote_code)
    config = loading.hf_config(source, trust_remote_code=ask.load.trust_remote_code)
    n_layers = int(config.num_hidden_layers)
    fa = None if ask.states is None else open_files(ask.states, ask.state_layers, "--states")
    fb = (
        None
        if ask.against_states is None
        else open_files(ask.against_states, ask.state_layers, "--against-states")
    )
    seqs, pairs = _seqs(ask, fa, fb, tokenizer, config, source)
    for side, held_files in (("A", fa), ("B", fb)):
        for f in held_files.files.values() if held_files else ():
            _fits(f, config, n_layers, ask.sites, side)
    both = set(_layers(fa, pairs, n_layers, 0)) & set(_layers(fb, pairs, n_layers, 1))
    items = None if ask.asked.layers is None else layer_items(ask.asked.layers)
    shown = [x for x in resolve_layers(items, n_layers) if x in both]
    if not shown:
        raise UsageError(
            f"the two sides hold none of the layers asked for (both hold {span(sorted(both))})"
        )
    session = _session(ask)
    guarded = nullcontext() if session is None else session.guarded()
    with guarded, tempfile.TemporaryDirectory(prefix="embedlens-parity-") as spill:
        mine = list(range(len(seqs))) if session is None else list(session.share(len(seqs)))
        b_stacks = _side_b(ask, fb, pairs, seqs, mine, Path(spill))
        tails = _tails(ask, fa, fb, tokenizer, n_layers, config)
        tally = Tally(tails, shown, n_layers if n_layers in both else None, ask.sites)
        for i, a in _side_a(ask, fa, pairs, seqs, mine):
            tally.add(i, a, b_stacks[i], seqs[i].positions)
        if session is not None:
            tally.done = [f for part in session.all_gather(tally.done) for f in part]
    return _report(ask, tally, fa, fb)


def _session(ask: Ask) -> Session | None:
    """Under torchrun, this process's part (the group joined); None alone."""
    from embedlens.analysis import torchrun

    return torchrun.split_session(ask.dist_backend, ask.load.device)


def _layers(
    files: Files | None, pairs: list[tuple[str, str]], n_layers: int, side: int
) -> list[int]:
    """The layers a side holds: its files' (the first's), or every layer of a model run."""
    if files is None:
        return list(range(n_layers + 1))
    return list(files.files[pairs[0][side]].layers)


def _seqs(
    ask: Ask, fa: Files | None, fb: Files | None, tokenizer: Any, config: Any, source: Any
) -> tuple[list[Seq], list[tuple[str, str]]]:
    """The sequences, and the files of each (A's name, B's name) where a side is files."""
    given = [x for x in (ask.inp.prompt, ask.inp.prompts, ask.inp.text) if x is not None]
    if fa is None and fb is None:
        if len(given) != 1:
            raise UsageError("give a PROMPT, --prompts FILE or --text FILE (or --states FILE)")
        return sequences(ask.inp, ask.asked, tokenizer, config, source), []
    if given:
        raise UsageError("a states file holds the ids: PROMPT, --prompts and --text do not apply")
    if fa is not None and fb is not None:
        pairs = paired(fa, fb)
        for x, y in pairs:
            check_files(fa.files[x], fb.files[y])
    else:
        one = fa or fb
        assert one is not None
        pairs = [(n, n) for n in one.files]
    held = fa or fb
    assert held is not None
    key = 0 if fa is not None else 1
    out = []
    for pair in pairs:
        ids = held.files[pair[key]].token_ids()
        out.append(Seq(pair[key], ids, list(range(len(ids)))))
    return out, pairs


def _fits(file: Held, config: Any, n_layers: int, sites: tuple[str, ...], side: str) -> None:
    """A side's file fits the model (its width, its layers) and holds the sites asked for."""
    from embedlens.analysis.lens.tuned_folder import config_size

    held = tuple(getattr(file, "sites", ("resid",)))
    lacking = [s for s in sites if s not in held]
    if lacking:
        raise UsageError(
            f"'{file.path.name}' ({side}) does not hold --site {lacking[0]}: it holds "
            f"{', '.join(held)}",
            hint="save the sites with `lens MODEL PROMPT --site SITES --save-states FILE`",
        )
    hidden = config_size(config)[0]
    if hidden is not None and file.hidden_size != hidden:
        raise UsageError(
            f"'{file.path.name}' holds states of width {file.hidden_size}, but the model's hidden "
            f"size is {hidden}: they are not this model's"
        )
    past = [x for x in file.layers if x > n_layers]
    if past:
        raise UsageError(
            f"'{file.path.name}' holds layer {past[0]}, but the model has layers 0..{n_layers}: "
            "the states are not this model's, or --state-layers is wrong"
        )


def _side_b(
    ask: Ask,
    fb: Files | None,
    pairs: list[tuple[str, str]],
    seqs: list[Seq],
    mine: list[int],
    spill: Path,
) -> dict[int, Stack]:
    """B's stacks of the sequences `mine`: its files, or the model run on each (then freed;
    its states past `live_stacks`' memory kept in the folder `spill`)."""
    if fb is not None:
        return {i: file_stack(seqs[i].name, fb.files[pairs[i][1]]) for i in mine}
    load = dataclasses.replace(ask.load, dtype=ask.against_dtype, revision=ask.against_revision)
    run = [seqs[i] for i in mine]
    stacks = live_stacks(ask.against, load, run, ask.against_revision, ask.sites, spill)
    return dict(zip(mine, stacks, strict=True))


def _side_a(
    ask: Ask, fa: Files | None, pairs: list[tuple[str, str]], seqs: list[Seq], mine: list[int]
) -> Iterator[tuple[int, Stack]]:
    """A's stacks of the sequences `mine`, one at a time: its files, or the model run on each."""
    if fa is not None:
        for i in mine:
            yield i, file_stack(seqs[i].name, fa.files[pairs[i][0]])
        return
    if not mine:
        return
    from embedlens.analysis.lens import options as checks
    from embedlens.analysis.lens.opening import open_model
    from embedlens.analysis.lens.states_file import states_of

    loading = checks.loading(ask.model, ask.load)
    with open_model(ask.model, None, loading, lambda *_: None) as (opened, _):
        for i in mine:
            states = states_of(opened, seqs[i].ids, ask.load.revision, {}, ask.sites)
            yield i, held(seqs[i], states[0], states[1], states[3])


def _tails(
    ask: Ask,
    fa: Files | None,
    fb: Files | None,
    tokenizer: Any,
    n_layers: int,
    config: Any,
) -> Tails:
    """Each side's decoder: its model's tail in --head-dtype, else the dtype its blocks ran in
    (a states side: --dtype); one tail when both are the same."""
    from embedlens.analysis.lens.blocks import ModelDecoder
    from embedlens.analysis.lens.decoders import open_tail
    from embedlens.io.source import resolve
    from embedlens.model.loading import torch_dtype

    a_key = (ask.model, tail_dtype(ask, fa, ask.load.dtype))
    b_model = ask.model if fb is not None else ask.against
    b_key = (b_model, tail_dtype(ask, fb, ask.against_dtype))
    made: dict[tuple[str, str], Any] = {}
    for name, dt in (a_key, b_key):
        if (name, dt) not in made:
            d = torch_dtype(dt)
            tail = open_tail(
                resolve(name, ask.load.revision if name == ask.model else ask.against_revision),
                d,
                trust_remote_code=ask.load.trust_remote_code,
            )
            made[(name, dt)] = ModelDecoder(tail.model, tail.blocks, 0)
    vocab = min(len(tokenizer), int(getattr(config, "vocab_size", len(tokenizer))))

    def token(i: int) -> str:
        return str(tokenizer.decode([i]))

    return Tails(made[a_key], made[b_key], n_layers, vocab, token)


def _report(ask: Ask, tally: Tally, fa: Files | None, fb: Files | None) -> LensParityReport:
    from embedlens.reports.lens_parity import LensParityReport

    rows = tally.layer_rows()
    threshold = THRESHOLD if ask.asked.threshold is None else ask.asked.threshold
    a_name = ask.model if fa is None else os.fspath(fa.where)
    a = _side(ask, a_name, fa, ask.load.dtype, tally, 0)
    b_name = ask.against if fb is None else os.fspath(fb.where)
    b = _side(ask, b_name, fb, ask.against_dtype, tally, 1)
    return LensParityReport(
        model=ask.model,
        a=a,
        b=b,
        n_sequences=len(tally.done),
        n_tokens=sum(len(f.positions) for f in tally.done),
        num_layers=tally.tails.num_layers,
        threshold=threshold,
        first_divergent_layer=first_above(rows, threshold),
        layers=rows,
        output=tally.output(ask.cap),
        notes=[],
        sites=tally.site_rows(),
    )


def tail_dtype(ask: Ask, files: Files | None, run: str) -> str:
    """The dtype a side's tail decodes in: --head-dtype, else the side's run dtype (a states
    side: --dtype), float32 for 'auto'."""
    dtype = ask.head_dtype or (ask.load.dtype if files is not None else run)
    return "float32" if dtype == "auto" else dtype


def _side(ask: Ask, name: str, files: Files | None, run: str, tally: Tally, i: int) -> ParitySide:
    from embedlens.reports.lens_parity import ParitySide

    (diff, tol, made), tail = tally.check(i), tail_dtype(ask, files, run)
    kind, dtype = ("model", run) if files is None else ("states", _stored(files))
    if not made:
        said = "not made: no run kept the model's own logits and its last layer"
        return ParitySide(name, kind, dtype, tail, None, said, None, None)
    ok = diff <= tol
    said = (
        f"{'made' if ok else 'FAILED'}: the last layer decoded at the last position of "
        f"{made} sequence(s) against the model's own logits (max |Δ| = {diff:.2g})"
    )
    return ParitySide(name, kind, dtype, tail, ok, said, diff, tol)


def _stored(files: Files) -> str:
    """The dtype a side's files store (the first's; 'mixed' when they differ)."""
    found = {f.dtype for f in files.files.values()}
    return found.pop() if len(found) == 1 else "mixed"


_NOT_TAKEN = {
    "target": "the output is compared on every observed next token",
    "tuned": "parity compares the model's own decoding of the two runs",
    "jacobian": "parity compares the model's own decoding of the two runs",
    "compare_logit": "parity compares two runs, not two lenses",
    "grid": "parity reads every position",
    "skip_bad": "every prompt is compared",
}
"""The lens options a parity run refuses, and why."""


def lens_parity(
    model: str | os.PathLike[str] | LoadOptions,
    prompt: str | None = None,
    *,
    states: str | os.PathLike[str] | None = None,
    against_states: str | os.PathLike[str] | None = None,
    against: str | os.PathLike[str] | None = None,
    against_dtype: str | None = None,
    against_revision: str | None = None,
    head_dtype: str | None = None,
    state_layers: str | None = None,
    prompts: Iterable[str | Mapping[str, Any]] | PromptSource | None = None,
    text: TextAsk | str | os.PathLike[str] | None = None,
    cap: float = CAP,
    dist_backend: str = "auto",
    load: LoadOptions | None = None,
    options: LensOptions | None = None,
    **keywords: Unpack[LensKeywords],
) -> LensParityReport:
    """Two runs of the same weights compared layer by layer (docs/parity.md): A is `states` (a
    states file, or a folder of them a file per prompt) or `model` run here in `dtype`; B is
    `against_states`, or `against` (`model` by default) run here in `against_dtype` (`dtype` by
    default). The sequences are the states files' ids, else `prompt`, `prompts` or `text` (a
    path, or a `TextAsk` with its window options). Each side decodes through its model's tail
    in `head_dtype` (default: the dtype its blocks ran in; a states side: `dtype`). `threshold`
    (a LensOptions field): the RMS relative difference above which a layer is divergent (1e-3);
    `cap`: the importance-ratio cap (3.0); `layers`: the layers compared (all). Under torchrun
    the sequences are split over the processes (`dist_backend`), and every process returns
    the same report.
    """
    from embedlens.analysis.lens.options import sites_asked
    from embedlens.model.prompts import PromptSource
    from embedlens.options import lens_given

    name, load, asked = lens_given("lens_parity", model, load, options, dict(keywords))
    _check_asked(asked, against_states, against, against_dtype, head_dtype, cap)
    if isinstance(text, (str, os.PathLike)):
        text = TextAsk(text)
    source = None if prompts is None else PromptSource.of(prompts)
    return lens_parity_run(
        Ask(
            os.fspath(name),
            load,
            asked,
            states,
            against_states,
            os.fspath(against) if against is not None else os.fspath(name),
            against_dtype or load.dtype,
            against_revision,
            head_dtype,
            state_layers,
            float(cap),
            Input(prompt, source, text),
            dist_backend,
            tuple(x for x in sites_asked(asked.site, None) if x != "resid"),
        )
    )


def _check_asked(
    asked: LensOptions,
    against_states: object,
    against: object,
    against_dtype: str | None,
    head_dtype: str | None,
    cap: float,
) -> None:
    """Refuse what a parity run does not take, before any file is read."""
    from embedlens.model.loading import check_dtype

    default = LensOptionsDefault()
    for option, why in _NOT_TAKEN.items():
        if getattr(asked, option) != getattr(default, option):
            raise UsageError(f"{option} does not apply to a parity run ({why})")
    for dtype in (against_dtype, head_dtype):
        if dtype is not None:
            check_dtype(dtype)
    if against_states is not None and (against is not None or against_dtype is not None):
        raise UsageError("B is either --against-states or --against/--against-dtype, not both")
    if not (isinstance(cap, (int, float)) and not isinstance(cap, bool) and 1 < cap < math.inf):
        raise UsageError(f"--cap {cap}: give a ratio above 1")
    t = asked.threshold
    if t is not None and not (isinstance(t, (int, float)) and 0 <= t < math.inf):
        raise UsageError(f"--threshold {t}: give a relative difference of 0 or more")
