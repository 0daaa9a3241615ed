"""Whether B can be read against A, told from tokenizers and headers before any weight is read.

The same prompt ids go to both models, so B must give every id the token A gives it: the two
vocabularies are compared id by id as `vocab --against` compares them (`vocab.diff.compare`,
each token by its bytes). The lenses are compared layer by layer, so B must have as many blocks
as A, as many output rows (the softmax runs over all of them), and A's width (A's decoder reads
B's residual stream).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from embedlens.analysis.lens.options import Load
from embedlens.errors import UnsupportedError

if TYPE_CHECKING:
    from torch import nn

    from embedlens.io.source import ModelSource
    from embedlens.model.tokenizer import Vocab
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
        from embedlens.analysis.vocab.diff import compare
        from embedlens.analysis.vocab.fingerprint import fingerprint
        from embedlens.reports.vocab import Fingerprint

        diff = compare(a, b, b_name, fingerprint=Fingerprint(fingerprint(a), None, None, None))
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
    out = [f"{diff.same_ids:,} of {a.size:,} ids hold the same token ({diff.other_size:,} in "
           f"'{b_name}')"]  # fmt: skip
    if diff.shifts:
        s = diff.shifts[0]
        where = f"id {s.start:,}" if s.count == 1 else f"ids {s.start:,}-{s.stop:,}"
        out.append(f"{_tokens(diff.shifted)} have other ids there ({where} moved by {s.by:+,})")
    if diff.renamed_examples:
        r = diff.renamed_examples[0]
        out.append(
            f"{diff.renamed:,} id{'s' * (diff.renamed != 1)} hold other tokens (id {r.id:,}: "
            f"'{r.token}' here, "
            f"'{r.other_token}' there)"
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
