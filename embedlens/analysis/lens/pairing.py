"""Whether B can be read against A, told from tokenizers and headers before any weight is read;
and the two compared once both ran.

The same prompt ids go to both models, so B must give every id the token A gives it: the two
vocabularies are compared id by id as `vocab --against` compares them (`vocab.diff.compare`,
each token by its bytes). The lenses are compared layer by layer, so B must have as many blocks
as A, as many output rows (the softmax runs over all of them), and A's width (A's decoder reads
B's residual stream).

Every pair of rows compared was decoded in the same chunks by the same code (`against`): equal
residuals give equal bits, and a KL of exactly 0. KL is taken in float64 from the float32 logits,
on one thread (a row's sum split between threads would move its last bits with the machine's
load). torch is imported inside the functions that compare: the checks run without it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from embedlens.analysis.lens.options import Load
from embedlens.errors import UnsupportedError
from embedlens.model.tokens import id_text
from embedlens.reports.lens import LensCheck, LensDiff, LensDiffLayer, Prediction

if TYPE_CHECKING:
    import torch
    from torch import nn

    from embedlens.analysis.lens.report import LensResult
    from embedlens.analysis.lens.site_report import SiteLogits
    from embedlens.analysis.lens.stats import Top
    from embedlens.io.source import ModelSource
    from embedlens.model.tokenizer import Vocab
    from embedlens.reports.lens import LensDiffLayerStats, LensReport
    from embedlens.reports.vocab import VocabDiff


@dataclass(frozen=True)
class Side:
    """One model of the pair as the caller gave it."""

    model: str | os.PathLike[str] | nn.Module
    tokenizer: Any
    """The tokenizer given for it (None: its own)."""
    loading: Load | dict[str, bool]
    """How to load it from its files (a `Load`), or the loading options given for a loaded one."""

    @property
    def name(self) -> str:
        """The model as messages name it."""
        if isinstance(self.model, (str, os.PathLike)):
            return os.fspath(self.model)
        from embedlens.model.loaded import loaded_name

        return loaded_name(self.model)  # type: ignore[arg-type]

    @functools.cached_property
    def source(self) -> ModelSource | None:
        """Its files, resolved once (None for a model given loaded)."""
        if not isinstance(self.loading, Load):
            return None
        from embedlens.io.source import resolve

        assert isinstance(self.model, (str, os.PathLike))
        return resolve(os.fspath(self.model), self.loading.revision)


@dataclass(frozen=True)
class Pair:
    """A (MODEL) and B (--against), and the KL (nats) above which a layer counts as divergent."""

    a: Side
    b: Side
    threshold: float


@dataclass(frozen=True)
class Facts:
    """What a side's files (or loaded model) say about it before its weights are read."""

    vocab: Vocab | dict[str, int] | None
    """Its vocabulary; a token -> id map for a tokenizer without a `tokenizers` backend; None for
    a loaded model given without a tokenizer (B then reads A's ids with A's)."""
    layers: int | None
    outputs: int | None
    """Rows of its output (the config's vocabulary size), when known."""
    hidden: int | None = None
    """Its hidden size, when known."""


def check_pair(a: Side, b: Side) -> None:
    """Refuse (UnsupportedError, exit 1) a B that does not share A's vocabulary, its number of
    layers, its output size or its hidden size."""
    fa, fb = facts(a), facts(b)
    if fa.vocab is not None and fb.vocab is not None:
        _same_vocabulary(a.name, fa.vocab, b.name, fb.vocab)
    if fa.layers is not None and fb.layers is not None and fa.layers != fb.layers:
        raise UnsupportedError(
            f"'{b.name}' has {fb.layers} layers and '{a.name}' {fa.layers}: lens --against "
            "compares two models layer by layer, so both need the same number"
        )
    if fa.outputs is not None and fb.outputs is not None and fa.outputs != fb.outputs:
        raise UnsupportedError(
            f"'{b.name}' has {fb.outputs:,} output rows and '{a.name}' {fa.outputs:,}: their "
            "predictions cannot be compared token by token"
        )
    if fa.hidden is not None and fb.hidden is not None and fa.hidden != fb.hidden:
        raise UnsupportedError(
            f"'{b.name}' has a hidden size of {fb.hidden:,} and '{a.name}' {fa.hidden:,}: A's "
            "decoder cannot read B's residual stream (the residual KL)"
        )


def facts(side: Side) -> Facts:
    """The side's vocabulary, layers and output rows, from its tokenizer and headers."""
    source = side.source
    if source is None:
        from embedlens.analysis.lens.blocks import find_blocks

        layers = len(find_blocks(side.model).modules)  # type: ignore[arg-type]
        vocab = None if side.tokenizer is None else _tokenizer_vocab(side.tokenizer)
        return Facts(vocab, layers, None)
    from embedlens.io.checkpoint import open_checkpoint
    from embedlens.model.files import read_config

    trust = isinstance(side.loading, Load) and side.loading.trust_remote_code
    ckpt = open_checkpoint(source) if source.is_gguf else None  # the header, parsed once
    config = read_config(source, ckpt, trust_remote_code=trust)
    vocab = (
        _tokenizer_vocab(side.tokenizer)
        if side.tokenizer is not None
        else _file_vocab(source, None if ckpt is None else ckpt.gguf, trust)
    )
    return Facts(vocab, config.num_layers, config.vocab_size, config.hidden_size)


def _file_vocab(source: ModelSource, gguf: Any, trust: bool) -> Vocab | dict[str, int]:
    """The vocabulary from the model's files: tokenizer.json or GGUF metadata (built once for
    the run: `file_tokens.file_vocab`), else through transformers (a slow tokenizer)."""
    from embedlens.model.tokenizer import load_vocab

    try:
        if source.is_gguf and source.path is not None:
            from embedlens.model.file_tokens import file_vocab

            return file_vocab(source.path, gguf)
        return load_vocab(source, gguf)
    except UnsupportedError:
        from embedlens.model.loading import load_tokenizer

        return _tokenizer_vocab(load_tokenizer(source, trust_remote_code=trust))


def _tokenizer_vocab(tokenizer: Any) -> Vocab | dict[str, int]:
    """A transformers tokenizer's vocabulary: its `tokenizers` backend, else its token map."""
    from embedlens.model.tokenizer import vocab_from_tokenizer

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return vocab_from_tokenizer(backend, "the tokenizer given")
    return {str(t): int(i) for t, i in tokenizer.get_vocab().items()}


def _same_vocabulary(
    a_name: str, a: Vocab | dict[str, int], b_name: str, b: Vocab | dict[str, int]
) -> None:
    """Refuse two vocabularies that give some id different tokens, saying what differs."""
    if isinstance(a, dict) or isinstance(b, dict):
        ma, mb = _token_map(a), _token_map(b)
        if ma == mb:
            return
        same = sum(1 for t, i in ma.items() if mb.get(t) == i)
        what = [f"{same:,} of {len(ma):,} tokens keep their id in '{b_name}' ({len(mb):,} tokens)"]
    else:
        from embedlens.analysis.vocab.diff import compare as compare_vocab
        from embedlens.analysis.vocab.fingerprint import fingerprint
        from embedlens.reports.vocab import Fingerprint

        mine = Fingerprint(fingerprint(a), None, None, None)
        diff = compare_vocab(a, b, b_name, fingerprint=mine)
        if diff.same_ids == a.size == diff.other_size:
            return
        what = _what_differs(diff, a, b_name)
    raise UnsupportedError(
        f"'{b_name}' does not share the vocabulary of '{a_name}': " + "; ".join(what),
        hint=f"both models read the same ids, so each id must be the same token in both; "
        f"embedlens vocab {a_name} --against {b_name} lists every difference",
    )


def _what_differs(diff: VocabDiff, a: Vocab, b_name: str) -> list[str]:
    """What `vocab --against` found, in counts and a first example of each."""
    same = f"{diff.same_ids:,} of {a.size:,} ids hold the same token"
    out = [f"{same} ({diff.other_size:,} in '{b_name}')"]
    if diff.shifts:
        s = diff.shifts[0]
        where = f"id {s.start:,}" if s.count == 1 else f"ids {s.start:,}-{s.stop:,}"
        out.append(f"{_tokens(diff.shifted)} have other ids there ({where} moved by {s.by:+,})")
    if diff.renamed_examples:
        r = diff.renamed_examples[0]
        out.append(
            f"{diff.renamed:,} id{'s' * (diff.renamed != 1)} hold other tokens (id {r.id:,}: "
            f"'{r.token}' here, '{r.other_token}' there)"
        )
    if diff.added:
        out.append(f"{_tokens(diff.added)} only in '{b_name}'")
    return out


def _tokens(n: int) -> str:
    return f"{n:,} token" if n == 1 else f"{n:,} tokens"


def _token_map(vocab: Vocab | dict[str, int]) -> dict[str, int]:
    if isinstance(vocab, dict):
        return vocab
    return {str(t): int(i) for t, i in vocab.tokenizer.get_vocab(with_added_tokens=True).items()}


@dataclass(frozen=True)
class Named:
    """What the reports say of B, kept after it is freed: its name and its notes."""

    name: str
    notes: list[str]


def pair_report(
    report: LensReport,
    diffs: list[LayerDiff],
    b: LensResult,
    named: Named,
    threshold: float,
    tokenizer: Any,
    shown: list[int],
    inside: tuple[SiteLogits, SiteLogits] | None = None,
) -> LensReport:
    """A's report with, in `diff`, B against it at the position the report reads (`diffs`, from
    `compare`; `b`: B's result), B's notes after A's. `shown`: the layers the report holds (the
    first divergent layer is found among all of `diffs`); `inside`: A's rows inside the blocks
    and B's (`site_report.pair_sites`)."""
    tok = functools.cache(functools.partial(id_text, tokenizer))
    layers = [
        LensDiffLayer(
            **{f.name: getattr(d, f.name) for f in dataclasses.fields(d) if f.name != "against"},
            against_top=[
                Prediction(i, tok(i), p, lp)
                for i, p, lp in zip(d.against.ids, d.against.probs, d.against.logprobs, strict=True)
            ],
            **{f"against_{name}": value for name, value in d.against.stats.items()},
        )
        for d in diffs
        if d.layer in shown
    ]
    c = b.check
    check = LensCheck(c.max_abs_logit_diff, c.tolerance, c.ok, c.top1_agrees, c.suspect)
    diff = LensDiff(named.name, threshold, first_above(diffs, threshold), layers, check)
    report = dataclasses.replace(report, notes=[*report.notes, *named.notes], diff=diff)
    if inside is None:
        return report
    from embedlens.analysis.lens.site_report import pair_sites

    return pair_sites(report, *inside, report.position_index)


def first_above(rows: Sequence[LayerDiff | LensDiffLayerStats], threshold: float) -> int | None:
    """The first layer whose KL exceeds the threshold (a NaN never does), or None."""
    return next((row.layer for row in rows if row.kl > threshold), None)


@dataclass(frozen=True)
class LayerDiff:
    """A against B at one (layer, position)."""

    layer: int
    kl: float
    residual_kl: float
    top1_agree: bool
    target_logprob_delta: float | None
    against: Top
    """B's predictions there."""


def compare(a: LensResult, b: LensResult, position: int) -> list[LayerDiff]:
    """Every layer of A's result against B's at one position both read (on one thread: copying
    a few rows is too little work to share, and each parallel step waits for a busy core)."""
    import torch

    from embedlens.analysis.lens.blocks import one_thread

    assert a.kept is not None and b.kept is not None
    if a.vocab_size != b.vocab_size:
        raise UnsupportedError(
            f"the two models' outputs differ in size ({a.vocab_size:,} and {b.vocab_size:,} "
            "rows): their predictions cannot be compared token by token"
        )
    layers = a.layers
    with one_thread():
        lens_a, lens_b = (_lens_rows(r, layers, position) for r in (a, b))
        kl = kl_rows(torch.stack(lens_a), torch.stack(lens_b))
        own = [(a.kept.logits[(x, position)], a.kept.other[(x, position)]) for x in layers]
        residual_kl = _again(kl, list(zip(lens_a, lens_b, strict=True)), own)
    out = []
    for i, x in enumerate(layers):
        top_a, top_b = a.rows[(x, position)], b.rows[(x, position)]
        delta = None
        if top_a.target_logprob is not None and top_b.target_logprob is not None:
            delta = top_b.target_logprob - top_a.target_logprob
        agree = top_a.ids[0] == top_b.ids[0]
        out.append(LayerDiff(x, kl[i], residual_kl[i], agree, delta, top_b))
    return out


def _lens_rows(r: LensResult, layers: list[int], position: int) -> list[torch.Tensor]:
    """The lens row of each layer at a position: its kept logits, the model's own at the last
    layer (which a states file without the last layer does not ask for)."""
    kept = r.kept
    assert kept is not None

    def row(x: int) -> torch.Tensor:
        out = r.output_at(position) if x == r.num_layers else kept.logits[(x, position)]
        assert out is not None
        return out

    return [row(x) for x in layers]


Rows = list[tuple["torch.Tensor", "torch.Tensor"]]
"""(p, q) rows of logits, one pair per layer."""


def _again(kl: list[float], done: Rows, rows: Rows) -> list[float]:
    """`kl_rows` of the pairs `rows`, taking the figure of `done`'s pair at the same layer
    where both rows hold the same bits as that pair's (A's own rows are its lens rows below
    the last layer; B's residual through A's decoder is B's lens where their tails match)."""
    import torch

    out = list(kl)
    todo = [
        i
        for i, ((p, q), (p0, q0)) in enumerate(zip(rows, done, strict=True))
        if not (same_bits(p, p0) and same_bits(q, q0))
    ]
    if todo:
        p, q = (torch.stack([rows[i][j] for i in todo]) for j in (0, 1))
        for i, value in zip(todo, kl_rows(p, q), strict=True):
            out[i] = value
    return out


def kl_rows(p: torch.Tensor, q: torch.Tensor) -> list[float]:
    """KL(softmax p ‖ softmax q) of each pair of rows of logits [n, V], in nats (float64); q is
    moved to p's device (two models may sit on different devices). Each row's figure depends on
    that row's logits alone (one thread): a row gives the same bits in any stack of rows."""
    import torch

    from embedlens.analysis.lens.blocks import one_thread

    with one_thread():
        lp = torch.log_softmax(p.double(), dim=-1)
        lq = torch.log_softmax(q.to(p.device).double(), dim=-1)
        terms = lp.exp().mul_(lp - lq)
        if bool(torch.isinf(p).any()):  # logits without an infinity have no log p of -inf
            terms = torch.where(torch.isneginf(lp), 0.0, terms)  # 0 log 0 = 0
        return terms.sum(dim=-1).clamp_min(0.0).tolist()


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether two rows hold the same bits (then any computation on them gives the same)."""
    import torch

    if x is y:
        return True
    alike = x.dtype == y.dtype and x.shape == y.shape and x.device == y.device
    if not alike or not (x.is_contiguous() and y.is_contiguous()):
        return False
    return bool(torch.equal(x.view(torch.uint8), y.view(torch.uint8)))
