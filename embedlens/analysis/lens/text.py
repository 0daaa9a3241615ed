"""`lens_text`: the lens over every scored token of a text, alone or against another model (or a
saved run's output), with llama-perplexity's statistics (`text_stats`) at every layer.

The text is read and checked before any model loads, tokenised once (`text_input`), cut into
windows, and each window run through the model(s) (`text_run`); only sums and per-token KL and
Δp values are kept. Under torchrun, window w runs on rank w mod N and the windows' sums are
combined in window order on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Unpack

from embedlens.analysis.lens import options
from embedlens.analysis.lens.site_report import sites_asked
from embedlens.analysis.lens.states_file import ManySaver, saving_many
from embedlens.analysis.lens.text_input import Rule, Tokens, read_text, rule, tokenise
from embedlens.analysis.lens.tuned_folder import fits_tuned
from embedlens.errors import UsageError
from embedlens.options import LoadKeywords, LoadOptions

if TYPE_CHECKING:
    from torch import nn

    from embedlens.analysis.dist import Session
    from embedlens.analysis.lens.logits_file import LogitsFile
    from embedlens.analysis.lens.opening import Opened
    from embedlens.analysis.lens.text_run import Side, TextRun, Window
    from embedlens.analysis.lens.text_stats import TextTotals, WindowSums
    from embedlens.progress import Progress
    from embedlens.reports.lens_text import LensTextReport


def lens_text(
    model: str | os.PathLike[str] | nn.Module | LoadOptions,
    text: str | os.PathLike[str],
    *,
    tokenizer: Any = None,
    ctx: int = 512,
    stride: int | None = None,
    max_tokens: int | None = None,
    score: str = "half",
    layers: str | Sequence[int] | None = None,
    against: str | os.PathLike[str] | nn.Module | None = None,
    against_tokenizer: Any = None,
    against_revision: str | None = None,
    against_logits: str | os.PathLike[str] | None = None,
    save_logits: str | os.PathLike[str] | None = None,
    residual: bool = True,
    tuned: str | os.PathLike[str] | None = None,
    site: str | Sequence[str] | None = None,
    save_states: str | os.PathLike[str] | None = None,
    load: LoadOptions | None = None,
    dist_backend: str = "auto",
    progress: Progress | None = None,
    **keywords: Unpack[LoadKeywords],
) -> LensTextReport:
    """The lens over the text file `text`: per layer, cross-entropy against the true next token
    (nats, bits per byte), KL to the model's output, entropy and top-1 accuracy; at the output
    the perplexity.

    ctx, stride: windows of `ctx` tokens every `stride` (ctx by default); score: 'half' (the
        second half of each window, llama-perplexity's rule) or 'all'; max_tokens: the text's
        first tokens only.
    against: B, compared at every layer with llama-perplexity's KL table (this model is the
        reference, llama.cpp's 'base'; B the evaluated, its 'Q'); residual: also the KL of this
        model's decoder on B's residual.
    against_logits: a file `save_logits` wrote (the reference); this model is evaluated.
    save_logits: write the output's top-k log-probabilities for a later `against_logits`.
    tuned: a lens folder: the tuned lens's statistics, the logit lens's beside them; with
        `against`, B read through the same lens (tuned on this model).
    site: statistics per (layer, site) (and B's against A's); save_states: a file a window.
    load: `LoadOptions` (or its fields as keywords: `dtype=`, ...), on one device.
    dist_backend: under torchrun, the windows are split over the processes.
    progress: called as `progress("text", scored, to_score, "tokens")` after each window.
    """
    from embedlens.analysis.lens import api
    from embedlens.progress import progress_of

    model, load = api.model_and_load("lens_text", model, load, dict(keywords))
    sites = _check(load, against, against_logits, tuned, site)
    r = rule(ctx, stride, score, max_tokens)
    items = None if layers is None else options.layer_items(layers)
    body = read_text(text)
    reference = None if against_logits is None else _reference_file(against_logits)
    session = _joined(dist_backend, load.device, against)
    with nullcontext() if session is None else session.guarded():
        saving = saving_many(save_states, load.revision, against, session, "--text")
        loading = api.loading(model, load)
        b = (against, against_tokenizer, against_revision)
        return _run(model, tokenizer, loading, (os.fspath(text), body, r, items), b,
                    (tuned, reference, save_logits, residual, sites, saving), session,
                    progress_of(progress, "lens_text"))  # fmt: skip


def _reference_file(path: str | os.PathLike[str]) -> LogitsFile:
    """A `save_logits` file, read and checked (the reference run)."""
    from embedlens.analysis.lens import logits_file

    return logits_file.load(path)


def _check(
    load: LoadOptions, against: object, against_logits: object, tuned: object, site: Any
) -> tuple[str, ...]:
    """What `lens_text` cannot combine, refused before any file is read; the sites asked."""
    if load.device_map is not None or load.max_memory is not None or load.offload_folder:
        raise UsageError("lens_text runs the model on one device: --device-map does not apply")
    if against is not None and against_logits is not None:
        raise UsageError("give --against or --against-logits, not both")
    sites = sites_asked(site, tuned)
    return sites


def _run(
    model: object,
    tokenizer: Any,
    load: options.Load | dict[str, bool],
    asked: tuple[str, str, Rule, Any],
    b: tuple[Any, Any, str | None],
    more: tuple[Any, LogitsFile | None, Any, bool, tuple[str, ...], Any],
    session: Session | None,
    progress: Progress,
) -> LensTextReport:
    """`lens_text` once its options are checked: the model(s) ready, every window run."""
    from embedlens.analysis.lens.opening import open_model

    name, body, r, items = asked
    tuned, reference, save_logits, residual, sites, saving = more
    lens_dir = None
    if tuned is not None:
        from embedlens.analysis.lens.decoders import open_tuned

        lens_dir = open_tuned(tuned)

    def check(tok: Any, config: Any, _template: str) -> Tokens:
        fits_tuned(lens_dir, config)
        _check_ctx(config, r)
        return tokenise(body, tok, r, name)

    with ExitStack() as stack:
        opened, tokens = stack.enter_context(open_model(model, tokenizer, load, check))
        other = stack.enter_context(_other(opened, *b, load, lens_dir))
        run = _text_run(opened, items, other, lens_dir, (save_logits, residual, sites))
        saver = None if saving is None else ManySaver(saving[0], opened, saving[1], sites)
        totals = _all(run, (r, name), tokens, reference, (session, saver), progress)
        report = _report(opened, run, totals, (name, r, tokens), other, reference)
        if save_logits is not None and (session is None or session.rank == 0):
            _save(save_logits, opened, r, tokens, totals, run.vocab)
        return report


def _check_ctx(config: Any, r: Rule) -> None:
    """A window longer than the model's positions is refused."""
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and r.ctx > limit:
        raise UsageError(f"--ctx {r.ctx} is longer than the model's {limit:,} positions")


def _joined(backend: str, device: str, against: object) -> Session | None:
    """Under torchrun: this process's part (the group joined); None alone."""
    from embedlens.runtime import world

    if world()[1] == 1:
        return None
    if against is not None:
        raise UsageError(
            "under torchrun, lens --text splits the windows over processes: --against (two "
            "models in turn) runs in one process only",
            hint="run it without torchrun, or save the reference with --save-logits and use "
            "--against-logits",
        )
    from embedlens.analysis import torchrun

    return torchrun.split_session(backend, device)


@contextmanager
def _other(
    opened: Opened,
    against: object,
    tokenizer: Any,
    revision: str | None,
    load: Any,
    lens_dir: Any = None,
) -> Iterator[Opened | None]:
    """B, checked against A (vocabulary, layers, outputs) and loaded as A was (None without);
    a tuned lens (A's) is checked against B's size before B's weights are read."""
    if against is None:
        yield None
        return
    from dataclasses import replace

    from embedlens.analysis.lens import api
    from embedlens.analysis.lens.opening import open_model
    from embedlens.analysis.lens.pairing import Side, check_pair

    if isinstance(load, options.Load):
        a_load = LoadOptions(dtype=load.dtype, device=load.device,
                             trust_remote_code=load.trust_remote_code)  # fmt: skip
    else:
        a_load = LoadOptions()
    b_load = api.loading(against, replace(a_load, revision=revision))
    a = Side(opened.model if not isinstance(load, options.Load) else opened.name,
             opened.tokenizer, load)  # fmt: skip
    check_pair(a, Side(against, tokenizer, b_load))  # type: ignore[arg-type]
    b_tok = tokenizer if tokenizer is not None or isinstance(b_load, options.Load) else None
    b_tok = b_tok if b_tok is not None or isinstance(b_load, options.Load) else opened.tokenizer

    def fits(_tok: Any, config: Any, _template: str) -> None:
        fits_tuned(lens_dir, config)

    with open_model(against, b_tok, b_load, fits) as (other, _):
        yield other


def _text_run(
    opened: Opened,
    items: Any,
    other: Opened | None,
    lens_dir: Any,
    more: tuple[object, bool, tuple[str, ...]],
) -> TextRun:
    """The window runner for A (its tuned lens beside the logit lens, the sites asked), and B
    (through the same tuned lens: A's, checked against B's blocks alone); `more`: where the
    logits are saved, whether B's residual is read by A, the sites."""
    from embedlens.analysis.lens.blocks import ModelDecoder, find_blocks
    from embedlens.analysis.lens.text_run import Side, TextRun

    def side(o: Opened, own: bool = True) -> Side:
        dummy = o.tokenizer.eos_token_id or 0
        plain = ModelDecoder(o.model, find_blocks(o.model), dummy_id=int(dummy))
        if lens_dir is None:
            return Side(o.model, plain)
        from embedlens.analysis.lens.decoders import tuned_through

        wrap = tuned_through(lens_dir, o.model, o.tokenizer, fingerprints=own).wrap
        return Side(o.model, wrap(plain), logit=plain if own else None)

    main = side(opened)
    n_layers = len(find_blocks(opened.model).modules)
    layers = sorted(set(options.resolve_layers(items, n_layers)) | {n_layers})
    vocab = min(len(opened.tokenizer), _outputs(opened))
    b = None if other is None else side(other, own=False)
    save_logits, residual, sites = more
    return TextRun(main, layers, vocab, b, keep_logits=save_logits is not None,
                   residual=residual, sites=sites)  # fmt: skip


def _outputs(opened: Opened) -> int:
    get: Any = getattr(opened.model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if weight is not None else len(opened.tokenizer)


def windows(r: Rule, tokens: Tokens) -> list[Window]:
    """Every window of the text (ids with the BOS first when the tokenizer adds one)."""
    from embedlens.analysis.lens.text_run import Window

    pos = r.scored()
    out = []
    for index, start in enumerate(r.starts(len(tokens.ids))):
        ids = tokens.ids[start : start + r.ctx]
        if tokens.bos is not None:
            ids = [tokens.bos, *ids[1:]]
        targets = [ids[j + 1] for j in pos]
        n_bytes = sum(tokens.n_bytes[start + j + 1] for j in pos)
        out.append(Window(index, ids, pos, targets, n_bytes))
    return out


def _all(
    run: TextRun,
    what: tuple[Rule, str],
    tokens: Tokens,
    reference: LogitsFile | None,
    split: tuple[Session | None, ManySaver | None],
    progress: Progress,
) -> TextTotals:
    """Every window run (this process's share under torchrun), the sums combined; with a
    saver, each window's states saved (rank 0 writes them all, `ManySaver`)."""
    from embedlens.analysis.lens.text_stats import TextTotals
    from embedlens.runtime import heap_kept

    (r, name), (session, saver) = what, split
    found = windows(r, tokens)
    if saver is not None:
        saver.keep = session is not None and session.rank != 0
    if reference is not None:
        reference.check_run(tokens.ids, r.ctx, r.stride, r.score, run.vocab)
    totals = TextTotals(run.layers)
    total = sum(len(w.positions) for w in found)
    done = 0
    mine: list[WindowSums] = []
    with heap_kept():
        for w in _mine(found, session, saver):
            ref = None if reference is None else _reference(reference, w.index)
            mine.append(run.run(w, ref))
            if saver is not None:
                about = {"text": name, "window": str(w.index + 1), "start": str(w.index * r.stride)}
                saver.put(w.index + 1, w.ids, about)
            n = len(w.positions)
            done = done + n if session is None else session.total("text", n)
            if session is None or session.rank == 0:
                progress("text", done, total, "tokens")
    if session is None:
        for s in mine:
            totals.add(s)
    else:
        totals.merged(session.all_gather(mine))
        if run.check is not None:
            checks = [c for c in session.all_gather(run.check) if c is not None]
            run.check = max(checks)
    return totals


def _mine(
    found: list[Window], session: Session | None, saver: ManySaver | None
) -> Iterator[Window]:
    """This process's windows (under torchrun window w runs on rank w mod N), and a saver's
    states handed to rank 0 after each round of N windows (every rank takes part)."""
    for w in found:
        if session is None:
            yield w
            continue
        session.check()
        if saver is not None and w.index % session.size == 0 and w.index:
            saver.hand_on(session)
        if w.index % session.size == session.rank:
            yield w
    if session is not None and saver is not None:
        saver.hand_on(session)


def _reference(reference: LogitsFile, index: int) -> Any:
    import torch

    from embedlens.analysis.lens.text_run import Reference

    rows = reference.window(index)
    return Reference(
        torch.from_numpy(rows["ids"]).long(),
        torch.from_numpy(rows["logp"]),
        torch.from_numpy(rows["target_logp"]),
        torch.from_numpy(rows["top1"]).long(),
    )


def _report(
    opened: Opened,
    run: TextRun,
    totals: TextTotals,
    what: tuple[str, Rule, Tokens],
    other: Opened | None,
    reference: LogitsFile | None,
) -> LensTextReport:
    from embedlens.analysis.lens.report import dtype_name
    from embedlens.reports.lens_text import LensTextReport

    name, r, tokens = what
    ppl, ppl_err = totals.perplexity()
    diff, tol = run.check or (0.0, 0.0)
    tuned = run.main.logit is not None
    report = LensTextReport(
        model=opened.name,
        text=name,
        n_text_tokens=len(tokens.ids),
        ctx=r.ctx,
        stride=r.stride,
        score=r.score,
        n_windows=len(r.starts(len(tokens.ids))),
        n_scored=totals.n,
        n_bytes=totals.n_bytes,
        num_layers=run.n_layers,
        dtype=dtype_name(opened.model),
        perplexity=ppl,
        perplexity_err=ppl_err,
        layers=totals.one(),
        lens="tuned" if tuned else "logit",
        logit_layers=totals.one(logit=True) if tuned else None,
        check_ok=not diff > tol,
        max_abs_logit_diff=diff,
        notes=[*opened.before, *opened.after],
    )
    if other is None and reference is None:
        return _with_sites(report, totals, run.sites)
    from dataclasses import replace

    if reference is not None:
        totals.pair_layers = [run.n_layers]
        ref_name, evaluated = str(reference.meta.get("model", reference.path)), opened.name
    else:
        assert other is not None
        ref_name, evaluated = opened.name, other.name
    report = replace(
        report,
        reference=ref_name,
        evaluated=evaluated,
        pair=totals.pair(residual=other is not None and run.residual),
        pair_output=totals.pair_output(),
    )
    return _with_sites(report, totals, run.sites, paired=other is not None)


def _with_sites(
    report: LensTextReport, totals: TextTotals, sites: tuple[str, ...], paired: bool = False
) -> LensTextReport:
    """The report with a row per (layer, site asked) in block order, and the blocks' check
    over every window (`paired`: the comparison's rows too, B's sites against A's); the report
    itself for `resid` alone."""
    if sites == ("resid",):
        return report
    from dataclasses import replace

    from embedlens.analysis.lens.site_report import worse
    from embedlens.reports.lens import BlockSums
    from embedlens.reports.lens_text import TextSiteLayer
    from embedlens.reports.lens_text import TextSitePairLayer as Paired

    blocks: BlockSums | None = None
    for w in totals.windows:
        assert w.blocks is not None
        blocks = worse(blocks, w.blocks)
    pair = report.pair
    if paired:
        residual = pair is not None and pair[0].residual_kl is not None
        pair = _site_rows(totals, sites, Paired,
                          lambda s: totals.pair(residual and s == "resid", site=s))  # fmt: skip
    layers = _site_rows(totals, sites, TextSiteLayer, lambda s: totals.one(site=s))
    return replace(report, layers=layers, pair=pair, sites=list(sites), block_sums=blocks)


def _site_rows(
    totals: TextTotals, sites: tuple[str, ...], kind: type[Any], per_site: Any
) -> list[Any]:
    """A row of `kind` per (layer, site) in block order, from `per_site(site)`'s rows per layer
    (layer 0: the embedding's residual stream alone)."""
    from dataclasses import asdict

    from embedlens.analysis.lens.site_report import SUFFIX

    each = {site: per_site(site) for site in sites}
    return [
        kind(**asdict(each[site][i]), site=site, row=f"{layer}{SUFFIX[site]}")
        for i, layer in enumerate(totals.layers)
        for site in sites
        if site == "resid" or layer >= 1
    ]


def _save(
    path: Any, opened: Opened, r: Rule, tokens: Tokens, totals: TextTotals, vocab: int
) -> None:
    from embedlens.analysis.lens import logits_file
    from embedlens.analysis.lens.text_run import TOP_K

    meta = {"model": opened.name, "ctx": r.ctx, "stride": r.stride, "score": r.score,
            "vocab": vocab, "top_k": TOP_K}  # fmt: skip
    logits_file.save(path, meta, tokens.ids, [w.extra for w in totals.windows])
