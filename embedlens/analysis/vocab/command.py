"""The `vocab` function: is this vocabulary healthy, trained, and the one these weights were
trained with?

The static parts read the headers, the tokenizer and the matrices (the head, then an untied
model's embedding), never torch: the vocabulary against the matrices' rows and the tokens the
tokenizer never produces on its own (`layout`), a fingerprint of the vocabulary
(`fingerprint`), and the under-trained signals (`undertrained`); `--against` compares two
vocabularies id by id (`diff`). `--verify` and `--check-fit` load the model (`fit`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embedlens.analysis.hub_reads import counts_hub_reads
from embedlens.analysis.vocab.diff import compare
from embedlens.analysis.vocab.facts import VocabFacts, facts_of, model_vocab
from embedlens.analysis.vocab.fingerprint import read_fingerprint
from embedlens.analysis.vocab.layout import against_rows
from embedlens.analysis.vocab.signals import Matrix
from embedlens.analysis.vocab.undertrained import scan
from embedlens.errors import UsageError
from embedlens.io.gguf import read_gguf_header
from embedlens.io.source import ModelSource, resolve
from embedlens.model.gguf_vocab import byte_level_merge_results
from embedlens.model.matrix import Table, locate, open_rows
from embedlens.model.tokenizer import (
    Vocab,
    check_tokenizer_json,
    load_vocab,
    vocab_from_file,
)
from embedlens.options import LoadOptions, no_other_keywords, one_device, renamed
from embedlens.progress import Progress, progress_of
from embedlens.reports.vocab import Fit, Undertrained, VocabDiff, VocabReport

MAX_VERIFY = 20


@dataclass(frozen=True)
class _Load:
    """How --verify and --check-fit load the model."""

    dtype: str
    device: str
    trust_remote_code: bool


@dataclass(frozen=True)
class _Asked:
    """What the loaded model is asked: --check-fit (with --tokenizer), --verify."""

    check_fit: bool
    verify: bool
    max_verify: int
    tokenizer: str | None


@counts_hub_reads
def vocab(
    model: str | os.PathLike[str],
    *,
    against: str | os.PathLike[str] | None = None,
    check_fit: bool = False,
    tokenizer: str | os.PathLike[str] | None = None,
    verify: bool = False,
    max_verify: int = MAX_VERIFY,
    show_all: bool | None = None,
    revision: str | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    trust_remote_code: bool = False,
    load: LoadOptions | None = None,
    progress: Progress | None = None,
    **keywords: Any,
) -> VocabReport:
    """Check MODEL's vocabulary against its matrices, scan for under-trained tokens, and (on
    request) compare it with another vocabulary (`against`) or measure whether the weights fit it
    (`check_fit`, with `tokenizer` another tokenizer than the model's own); `verify` asks the model
    to repeat the first `max_verify` candidates (`progress`, an `embedlens.progress.Progress`, is
    called as its batches run: stage 'verifying', unit 'batches'); `show_all` shows every candidate
    in the tables (`to_dict()`, the --json object, always holds every candidate and row). MODEL,
    `against` and `tokenizer` are text or paths (`pathlib.Path`); `load=`, a `LoadOptions`, may
    hold the loading keywords; `all=` and `on_progress=(done, total)` are deprecated names."""
    show_all = bool(renamed("vocab", keywords, "all", "show_all", show_all, "give"))
    old: Callable[[int, int], None] | None = renamed(
        "vocab", keywords, "on_progress", "progress", progress,
        "it is called as progress(stage, done, total, unit, detail=''): give",
    )  # fmt: skip
    progress = _progress(progress, old)
    no_other_keywords("vocab", keywords)
    revision, how = _how(model, load, revision, _Load(dtype, device, trust_remote_code))
    _check_arguments(model, max_verify)
    model, against, tokenizer = os.fspath(model), _text(against), _text(tokenizer)
    source = resolve(model, revision)
    table = locate(source, "output")
    matrices = _matrices(source, table)
    try:
        if tokenizer is None:
            vocab_used, facts = model_vocab(source, table.checkpoint.gguf)
            origin = vocab_used.origin
        else:
            (vocab_used, merged), origin = _load_other(tokenizer), tokenizer
            facts = facts_of(vocab_used, merged)
        other = load_other(against) if against is not None else None
        report = _static(model, origin, vocab_used, facts, matrices, table, shows_all=show_all)
    except BaseException:
        for m in matrices:  # their threads end with the scan; on an error, here
            if m.early is not None:
                m.early.wait()
        raise
    scanned, fit, notes = report.undertrained, None, list[str]()
    if check_fit or (verify and scanned.candidates):
        asked = _Asked(check_fit, verify, max_verify, tokenizer)
        scanned, fit, notes = _loaded(source, how, asked, vocab_used, scanned, table, progress)
    diff = None
    if other is not None and against is not None:
        diff = compare(vocab_used, other, against, fingerprint=report.fingerprint)
    return _finish(report, scanned, diff, fit, notes)


def _how(
    model: object, load: LoadOptions | None, revision: str | None, how: _Load
) -> tuple[str | None, _Load]:
    """The revision, and how `verify` and `check_fit` load the model (on one device): the
    keywords', or `load=`'s with the keywords given set on it."""
    if load is None:
        return revision, how
    trust = how.trust_remote_code
    given = dict(revision=revision, dtype=how.dtype, device=how.device, trust_remote_code=trust)
    options = one_device("vocab", model, load, given)
    return options.revision, _Load(options.dtype, options.device, options.trust_remote_code)


def _progress(progress: Progress | None, old: Callable[[int, int], None] | None) -> Progress:
    """`progress` as a Progress; the former `on_progress(done, total)` (`old`) adapted to it."""
    if old is None or progress is not None:
        return progress_of(progress, "vocab")

    def adapted(stage: str, done: int, total: int, unit: str, detail: str = "") -> None:
        old(done, total)

    return adapted


def _text(spec: str | os.PathLike[str] | None) -> str | None:
    """A path given as a `pathlib.Path` (any os.PathLike) as text; None stays None."""
    return None if spec is None else os.fspath(spec)


def _check_arguments(model: object, max_verify: int) -> None:
    if not isinstance(model, (str, os.PathLike)):
        raise UsageError(
            "vocab reads MODEL from its files: give a hub repo id, a folder or a .gguf file",
            hint="a loaded model's vocabulary cannot be checked against its checkpoint",
        )
    if max_verify < 1:
        raise UsageError(f"--max-verify must be at least 1 (got {max_verify})")


def _static(
    model: str,
    origin: str,
    vocab: Vocab,
    facts: VocabFacts,
    matrices: list[Matrix],
    table: Table,
    *,
    shows_all: bool,
) -> VocabReport:
    """Everything that reads headers, the tokenizer's facts and the matrices. Unreachable
    tokens are the tokenizer's, all of them (the same whatever weights it is checked against);
    the scan reads the rows there are."""
    rows = against_rows(vocab, table, facts.kinds, facts.named_unused)
    problems = list(rows.problems)
    prints = read_fingerprint(facts.fingerprint, table)
    if prints.matches is False:
        problems.append(
            f"the weights' metadata names tokenizer hash {prints.metadata_value} "
            "but this vocabulary's fingerprint differs"
        )
    scanned = scan(matrices, vocab, rows.tokens, all_tokens=True)
    problems.extend(_untrained_added(scanned))
    notes = [] if table.tied else list(table.notes)
    if vocab.size > table.rows:
        notes.append("tokens past the last row are left out of the scan")
    return VocabReport(
        model=model,
        tokenizer=origin,
        layout=rows.layout,
        fingerprint=prints,
        unreachable=facts.unreachable,
        undertrained=scanned,
        against=None,
        fit=None,
        problems=problems,
        notes=notes,
        shows_all=shows_all,
    )


def _untrained_added(scanned: Undertrained) -> list[str]:
    """A problem for added tokens whose rows look untrained: the model has not learnt them."""
    out = []
    for g in scanned.groups:
        if g.kind == "added_tokens" and g.verdict == "untrained":
            these = (
                f"the added token (id {g.first}) has a row"
                if g.count == 1
                else f"the {g.count:,} added tokens (ids {g.first}-{g.last}) have rows"
            )
            out.append(f"{these} that look untrained: the model has not learnt them")
    return out


def _matrices(source: ModelSource, table: Table) -> list[Matrix]:
    """The head (the embedding when tied), then an untied model's embedding, each with its
    component begun (`Matrix.begun`: found while the tokenizer is read)."""
    head = open_rows(source, table)
    embedding = None if table.tied else locate(source, "input")
    rows = None if embedding is None else open_rows(source, embedding)
    out = [Matrix.begun(head, table.name, "input" if table.tied else "output")]
    if embedding is not None and rows is not None:
        out.append(Matrix.begun(rows, embedding.name, "input"))
    return out


def _loaded(
    source: ModelSource,
    how: _Load,
    asked: _Asked,
    vocab: Vocab,
    scanned: Undertrained,
    table: Table,
    progress: Progress,
) -> tuple[Undertrained, Fit | None, list[str]]:
    """--verify and --check-fit: load the model once for both (and the notes of the fit)."""
    from embedlens.analysis.vocab import fit as vocab_fit

    model = vocab_fit.load(
        source, dtype=how.dtype, device=how.device, trust_remote_code=how.trust_remote_code
    )
    if asked.verify:
        scanned = vocab_fit.verify_candidates(
            model, vocab, scanned, max_verify=asked.max_verify, progress=progress
        )
    fit, notes = None, []
    if asked.check_fit:
        own, why = None, None
        if asked.tokenizer is not None:
            own, why = vocab_fit.own_reference(source, table.checkpoint.gguf, table.rows)
        if why is not None:
            notes.append(f"--check-fit: {why}: the losses are judged against a trained model's")
        name = asked.tokenizer or "model"
        is_own = asked.tokenizer is None
        fit = vocab_fit.check_fit(model, vocab, name, rows=table.rows, own=own, is_own=is_own)
    return scanned, fit, notes


def _finish(
    report: VocabReport,
    scanned: Undertrained,
    diff: VocabDiff | None,
    fit: Fit | None,
    notes: list[str],
) -> VocabReport:
    """The report with the model's answers and the comparison, their problems and notes added."""
    from dataclasses import replace

    from embedlens.analysis.vocab.fit import unfit

    problems = list(report.problems)
    if diff is not None and not diff.compatible:
        problems.extend(diff.summary)
    if fit is not None and not fit.fits:
        problems.append(unfit(fit))
    return replace(
        report,
        undertrained=scanned,
        against=diff,
        fit=fit,
        problems=problems,
        notes=[*report.notes, *notes],
    )


def load_other(spec: str) -> Vocab:
    """Another vocabulary: a tokenizer.json, a folder holding one, or any MODEL."""
    return _load_other(spec)[0]


def _load_other(spec: str) -> tuple[Vocab, frozenset[str] | None]:
    """Another vocabulary, and what a byte-level GGUF's merges build (as for the model's own)."""
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".json":
        check_tokenizer_json(path)
        return vocab_from_file(path), None
    if (
        path.is_dir()
        and (path / "tokenizer.json").is_file()
        and not (path / "config.json").is_file()
    ):
        check_tokenizer_json(path / "tokenizer.json")
        return vocab_from_file(path / "tokenizer.json"), None
    source = resolve(spec)
    if not source.is_gguf or source.path is None:
        return load_vocab(source), None
    header = read_gguf_header(source.path)
    return load_vocab(source, header), byte_level_merge_results(header)
