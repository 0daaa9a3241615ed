"""Every token id a run feeds a model has a row in its embedding: checked as each text is
tokenised (`file_tokens.check_ids`, in `file_tokens.watching`), before any forward pass, and for
a model read from its files before its weights are loaded (the rows come from the headers).
Before that, where a folder's tokenizer.json has an id past the rows, the texts are read with
the `tokenizers` library alone (`early`), so a tokenizer that does not belong is refused before
transformers is imported.

A tokenizer with more ids than the model has rows (SmolLM2's 49,152 beside a model of 2,048)
would otherwise fail inside the embedding's lookup; here it is one error that names both sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from embedlens.errors import ConfigError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from embedlens.io.source import ModelSource
    from embedlens.model.files import ModelFiles

_READS_OTHERWISE = ("auto_map", "split_special_tokens", "fix_mistral_regex", "add_prefix_space")
"""tokenizer_config.json settings under which transformers' ids may not be the `tokenizers`
library's reading of tokenizer.json (code of the model's own, special tokens split as text, a
pre-tokenizer replaced or told to add a space): the early check leaves such a tokenizer to the
exact one."""


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


def early(
    files: ModelFiles,
    name: str,
    others: tuple[ModelSource, ...] = (),
    *,
    trust_remote_code: bool = False,
) -> Callable[[str], None] | None:
    """A check of one text read as it is (a prompt, a --target), before transformers is
    imported: ConfigError, as `Rows.check` gives it, when the ids tokenizer.json's own reading
    gives the text's content have one past the rows of the model's embedding or `others'`
    (--against's B). None where it cannot tell: no folder tokenizer.json that the `tokenizers`
    library reads as transformers would, no rows in the headers, or no id of the tokenizer at or
    past the rows (nothing to check).

    Only the text's own ids are checked: the special tokens a post-processor adds are
    transformers' to decide (tokenizer_config.json's add_bos_token replaces it), so the exact
    check (`file_tokens.watching`) still sees every id."""
    tok = _own_tokenizer(files, trust_remote_code=trust_remote_code)
    if tok is None:
        return None
    from embedlens.model.files import check_source

    found = [(name, file_rows(files))]
    for other in others:
        found.append(
            (other.spec, file_rows(check_source(other, trust_remote_code=trust_remote_code)))
        )
    vocab = tok.get_vocab(with_added_tokens=True)
    high = max(vocab.values(), default=-1)
    size = int(tok.get_vocab_size(with_added_tokens=True))
    rows = tuple(Rows(model, n, size) for model, n in found if n is not None and high >= n)
    if not rows:
        return None

    def check(text: str) -> None:
        ids = tok.encode(text, add_special_tokens=False).ids
        for each in rows:
            each.check(ids)

    return check


def _own_tokenizer(files: ModelFiles, *, trust_remote_code: bool) -> Tokenizer | None:
    """A model's tokenizer.json read by the `tokenizers` library, where its ids for a text are
    transformers' (None elsewhere: a GGUF file, no tokenizer.json, settings that change the
    reading, code of the model's own, a file the library cannot read)."""
    import json

    source = files.source
    if source.is_gguf or files.config_json is None:
        return None
    if trust_remote_code and "auto_map" in files.config_json:
        return None
    settings_path = source.find("tokenizer_config.json")
    settings: Any = {}
    if settings_path is not None:
        try:
            settings = json.loads(settings_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
    if not isinstance(settings, dict) or any(settings.get(k) for k in _READS_OTHERWISE):
        return None
    path = source.find("tokenizer.json")
    if path is None:
        return None
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception:  # the Rust side raises a bare Exception; transformers then says why
        return None
    tok.no_truncation()  # as transformers reads one text: neither cut nor padded
    tok.no_padding()
    return tok
