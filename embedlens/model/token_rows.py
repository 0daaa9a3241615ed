"""Every token id a run feeds a model has a row in its embedding: checked as each text is
tokenised (`file_tokens.check_ids`, in `file_tokens.watching`), before any forward pass, and for
a model read from its files before its weights are loaded (the rows come from the headers).

A tokenizer with more ids than the model has rows (SmolLM2's 49,152 beside a model of 2,048)
would otherwise fail inside the embedding's lookup; here it is one error that names both sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from embedlens.errors import ConfigError

if TYPE_CHECKING:
    from embedlens.io.source import ModelSource
    from embedlens.model.files import ModelFiles


@dataclass(frozen=True)
class Rows:
    """A model's embedding rows, which every id fed to it must be below."""

    model: str
    """The model as messages name it."""
    rows: int
    tokens: int | None
    """The size of the tokenizer giving the ids (None: it does not say)."""

    def check(self, ids: Sequence[int]) -> None:
        """ConfigError when an id has no row."""
        high = max(ids, default=-1)
        if high < self.rows:
            return
        size = "" if self.tokens is None else f"has {self.tokens:,} ids and "
        raise ConfigError(
            f"the tokenizer {size}gives id {high:,}, but the embedding of '{self.model}' has "
            f"{self.rows:,} rows: the tokenizer and the model do not belong together",
            hint="use the model's own tokenizer (or a model whose embedding has a row for "
            "every id its tokenizer gives)",
        )


def tokenizer_size(tokenizer: Any) -> int | None:
    """How many ids the tokenizer has (added tokens included); None when it does not say."""
    try:
        return len(tokenizer)
    except (TypeError, ValueError):
        return None


def file_rows(files: ModelFiles) -> int | None:
    """The embedding's rows as the headers give them (None: no headers, or no embedding
    found)."""
    if files.checkpoint is None or files.embedding is None:
        return None
    entry = files.checkpoint.tensors.get(files.embedding)
    return None if entry is None or not entry.shape else int(entry.shape[0])


def of_files(
    files: ModelFiles,
    tokenizer: Any,
    name: str,
    others: tuple[ModelSource, ...] = (),
    *,
    trust_remote_code: bool = False,
) -> tuple[Rows, ...]:
    """The rows of a model read from its files, and of `others` run on the same ids (--against's
    B), each from its headers."""
    from embedlens.model.files import check_source

    size = tokenizer_size(tokenizer)
    found = [(name, file_rows(files))]
    for other in others:
        other_files = check_source(other, trust_remote_code=trust_remote_code)
        found.append((other.spec, file_rows(other_files)))
    return tuple(Rows(model, rows, size) for model, rows in found if rows is not None)


def of_loaded(model: Any, tokenizer: Any, name: str) -> tuple[Rows, ...]:
    """The rows of a model the caller loaded (its input embedding's weight)."""
    try:
        weight = model.get_input_embeddings().weight
        rows = int(weight.shape[0])
    except (AttributeError, TypeError, IndexError, NotImplementedError):
        return ()
    return (Rows(name, rows, tokenizer_size(tokenizer)),)
