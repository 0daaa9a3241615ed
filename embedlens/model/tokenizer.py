"""A model's vocabulary without transformers (`Vocab`): `tokenizers` over tokenizer.json or a
GGUF file's metadata.

`neighbors` and `addr` need three things from a tokenizer: encode a word without special tokens,
show one token's text, and know which ids are real tokens (below the tokenizer's length) and
which are special. The `tokenizers` library does all three in a fraction of the time transformers
takes to import. A GGUF file carries its vocabulary as metadata (read and checked in
`gguf_vocab`): byte-level BPE (`gpt2`) and SentencePiece BPE (`llama`) vocabularies are rebuilt
(`tokens`) the way transformers rebuilds them, and kept built in embedlens' cache
(gguf_cache): a 262k-piece vocabulary takes seconds to rebuild.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from embedlens.errors import CheckpointError, UnsupportedError
from embedlens.io.gguf import GGUFHeader, LazyArray, read_gguf_header
from embedlens.io.source import ModelSource
from embedlens.model import gguf_cache
from embedlens.model.gguf_vocab import (
    CONTROL,
    STRING,
    check_merges,
    checked_tokenizer,
    corrupt,
    gguf_kind,
    not_strings,
    numbers_at,
    unsupported_kind,
)
from embedlens.model.tokens import (
    add_gguf_tokens,
    build_gguf_tokenizer,
    byte_alphabet_spelling,
    first_ids,
    partial_tokenizer,
    token_text,
)
from embedlens.text import error_line

if TYPE_CHECKING:
    from tokenizers import Tokenizer

GGUF_ORIGIN = "GGUF metadata"


class Texts(Protocol):
    """Every id's text, by id."""

    def __len__(self) -> int: ...
    def __getitem__(self, token_id: int, /) -> str: ...


class PackedTexts:
    """Every id's text as one UTF-8 blob and where each text ends: a text is decoded when
    asked for (a run shows a few of 262,144)."""

    def __init__(self, ends: memoryview, blob: memoryview) -> None:
        self._ends, self._blob = ends, blob

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, i: int) -> str:
        start = self._ends[i - 1] if i > 0 else 0
        return bytes(self._blob[start : self._ends[i]]).decode("utf-8", "surrogatepass")


class Reader(Protocol):
    """Reads text with a few of a vocabulary's pieces at a time (gguf_words.WordReader)."""

    def encode(self, text: str) -> list[int]: ...
    def lookup(self, text: str) -> int | None: ...
    def piece(self, token_id: int) -> str | None: ...
    def decode(self, token_id: int) -> str: ...


@dataclass(frozen=True)
class Vocab:
    """A loaded tokenizer and the facts about its ids that the table commands need."""

    built: Tokenizer | None
    """The tokenizer; None for a vocabulary known from facts kept beside it (`loads` builds it
    when something asks: `tokenizer`)."""
    size: int
    """len(tokenizer): the ids below it are real tokens, rows at or beyond it are padding."""
    special_ids: frozenset[int]
    unk_id: int | None
    origin: str
    """Where it came from: 'tokenizer.json' or 'GGUF metadata'."""
    only: frozenset[int] | None = None
    """When set, the tokenizer holds just these ids (gguf_rows_vocab): it shows them, and
    refuses to encode or look up text."""
    pieces: tuple[str | None, ...] | None = field(default=None, compare=False, repr=False)
    """Every id's entry as the tokenizer stores it, when known without asking it (a GGUF)."""
    added: frozenset[int] = frozenset()
    """The ids of the tokens added on top of the tokenizer's model (specials included)."""
    texts: Texts | None = field(default=None, compare=False, repr=False)
    """Every id's text (`text`), when known without asking the tokenizer (kept facts)."""
    loads: Callable[[], Vocab] | None = field(default=None, compare=False, repr=False)
    """Builds the whole vocabulary when `built` is None."""
    reader: Reader | None = field(default=None, compare=False, repr=False)
    """Encodes, looks up and shows tokens in place of the tokenizer (built when `built` is
    None and something else asks for it)."""
    _text: dict[int, str] = field(default_factory=dict, compare=False, repr=False)
    _whole: list[Vocab] = field(default_factory=list, compare=False, repr=False)

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer, built on first use when only kept facts were read."""
        if self.built is not None:
            return self.built
        tok = self.whole().built
        assert tok is not None
        return tok

    def whole(self) -> Vocab:
        """This vocabulary with its tokenizer built (itself when it has one)."""
        if self.built is not None:
            return self
        if not self._whole:
            assert self.loads is not None, "a Vocab without a tokenizer has a loader"
            self._whole.append(self.loads())
        return self._whole[0]

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, no special tokens added (no BOS)."""
        self._refuse_text()
        if self.reader is not None:
            return self.reader.encode(text)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def _refuse_text(self) -> None:
        if self.only is not None:
            raise ValueError("this vocabulary holds only some ids: it cannot read text")

    def piece(self, token_id: int) -> str | None:
        """The vocabulary entry as stored ('Ġking', '▁king'), or None outside the vocabulary."""
        if self.reader is not None:
            return self.reader.piece(token_id)
        return self.tokenizer.id_to_token(token_id)

    def text(self, token_id: int) -> str:
        """One token's exact decoded text, its bytes as \\xNN when it is a partial UTF-8 sequence."""
        if self.texts is not None and 0 <= token_id < len(self.texts):
            return self.texts[token_id]
        if token_id in self._text:
            return self._text[token_id]
        piece = self.piece(token_id)
        if self.reader is not None:
            decoded = self.reader.decode(token_id)
        else:
            decoded = self.tokenizer.decode([token_id], skip_special_tokens=False)
        shown = token_text(decoded, piece)
        self._text[token_id] = shown
        return shown

    def lookup(self, text: str) -> int | None:
        """The id of the vocabulary entry spelled exactly `text` (stored form), if there is one."""
        self._refuse_text()
        if self.reader is not None:
            return self.reader.lookup(text)
        return self.tokenizer.token_to_id(text)


def load_vocab(
    source: ModelSource, gguf: GGUFHeader | None = None, *, only: Iterable[int] | None = None
) -> Vocab:
    """The model's tokenizer: tokenizer.json beside the weights, or a GGUF file's metadata
    (with `only`, just those ids of it: gguf_rows_vocab)."""
    if source.is_gguf:
        assert source.path is not None
        header = gguf or read_gguf_header(source.path)
        return vocab_from_gguf(header) if only is None else gguf_rows_vocab(header, only)
    path = source.find("tokenizer.json")
    if path is None:
        raise UnsupportedError(
            f"'{source.spec}' has no tokenizer.json",
            hint="embedlens reads fast tokenizers (tokenizer.json); save one with "
            "AutoTokenizer.from_pretrained(...).save_pretrained(folder)",
        )
    return vocab_from_file(path)


# What transformers takes from a tokenizer.json beside what the tokenizers library reads.
_TOKENIZER_JSON_KEYS = {"added_tokens": list, "model": dict}


def check_tokenizer_json(path: Path) -> None:
    """CheckpointError unless tokenizer.json is a JSON object with the keys transformers reads."""
    import json

    try:
        data = json.loads(path.read_bytes())
    except OSError as e:
        raise CheckpointError(f"cannot read '{path}': {e.strerror or e}") from e
    except (ValueError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
        raise CheckpointError(f"'{path.name}' is not valid JSON ({reason})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"'{path.name}' does not hold a JSON object")
    for key, kind in _TOKENIZER_JSON_KEYS.items():
        if not isinstance(data.get(key), kind):
            what = "has no" if key not in data else "has a malformed"
            raise CheckpointError(
                f"'{path.name}' {what} '{key}' {'list' if kind is list else 'object'}",
                hint="save the tokenizer again with a current tokenizers or transformers",
            )


def vocab_from_file(path: Path) -> Vocab:
    """Load tokenizer.json with the `tokenizers` library."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a bare Exception for a malformed file
        raise CheckpointError(f"cannot read tokenizer.json: {error_line(e)}") from e
    return _wrap(tok, "tokenizer.json", unk=_unk_token(tok))


def vocab_from_tokenizer(tok: Tokenizer, origin: str) -> Vocab:
    """A `tokenizers` Tokenizer already built (a transformers tokenizer's backend)."""
    return _wrap(tok, origin, unk=_unk_token(tok))


def vocab_from_gguf(header: GGUFHeader) -> Vocab:
    """Rebuild the tokenizer a GGUF file describes (byte-level or SentencePiece BPE), or load
    the one built before from the same metadata (`gguf_cache.kept_tokenizer`)."""
    meta = checked_tokenizer(header)
    kind, tokens, types = meta.kind, meta.tokens, meta.types
    spelled = byte_alphabet_spelling(tokens) if kind == "gpt2" else tokens
    tok = gguf_cache.kept_tokenizer(
        header, functools.partial(build_gguf_tokenizer, header, meta, spelled)
    )
    unk = header.metadata.get("tokenizer.ggml.unknown_token_id")
    special = {i for i, t in enumerate(types) if t == CONTROL}
    vocab = _wrap(tok, GGUF_ORIGIN, unk=unk if isinstance(unk, int) else None, special=special)
    return replace(vocab, pieces=stored_pieces(spelled, vocab.size))


def stored_pieces(spelled: list[str], size: int) -> tuple[str | None, ...]:
    """What get_vocab gives by id for a vocabulary built from these entries: each entry at its
    first id (a repeated entry's later ids have none), ids from `size` on left out."""
    if len(set(spelled)) == len(spelled):  # no entry repeated: each at its own id
        pieces: list[str | None] = list(spelled[:size])
    else:
        first = first_ids(spelled)
        pieces = [t if first[t] == i else None for i, t in enumerate(spelled[:size])]
    return tuple(pieces + [None] * (size - len(pieces)))


def gguf_rows_vocab(header: GGUFHeader, ids: Iterable[int]) -> Vocab:
    """A GGUF vocabulary that shows just the given ids, their pieces read straight from the
    token array: rebuilding a 262k-token tokenizer takes a second, this a few milliseconds.
    Each token is decoded by a tokenizer holding only the asked pieces, built as
    vocab_from_gguf builds the whole one, so its text is the same. A short vocabulary is
    loaded whole (vocab_from_gguf)."""
    kind = gguf_kind(header)
    value = header.metadata["tokenizer.ggml.tokens"]
    if not isinstance(value, LazyArray):
        return vocab_from_gguf(header)
    if value.item_type != STRING:
        raise not_strings(header, "tokenizer.ggml.tokens", value)
    if kind not in ("gpt2", "llama"):
        raise unsupported_kind(header, kind)
    merges = header.metadata.get("tokenizer.ggml.merges")
    check_merges(header, kind, merges is not None, "tokenizer.ggml.scores" in header.metadata)
    if isinstance(merges, LazyArray) and merges.item_type != STRING:
        raise not_strings(header, "tokenizer.ggml.merges", merges)
    types = numbers_at(header, "tokenizer.ggml.token_type", ids)
    numbers_at(header, "tokenizer.ggml.scores", ())
    pieces: dict[int, str] = {}
    for i, raw in value.items_at(ids).items():
        try:
            pieces[i] = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise corrupt(
                header, "tokenizer.ggml.tokens", i, f"{raw!r} is not valid UTF-8"
            ) from None
    order = sorted(pieces)
    tokens = [pieces[i] for i in order]
    kinds = [int(types.get(i, 0)) for i in order]
    try:
        tok = partial_tokenizer(dict(zip(tokens, order, strict=True)), byte_level=kind == "gpt2")
        add_gguf_tokens(tok, tokens, kinds, byte_level=kind == "gpt2")
    except Exception as e:  # the Rust side raises bare Exceptions on inconsistent vocabularies
        raise CheckpointError(
            f"'{header.path.name}' has a corrupt tokenizer: {error_line(e)}"
        ) from e
    unk = header.metadata.get("tokenizer.ggml.unknown_token_id")
    special = {i for i, t in zip(order, kinds, strict=True) if t == CONTROL}
    vocab = _wrap(tok, GGUF_ORIGIN, unk=unk if isinstance(unk, int) else None, special=special)
    return replace(vocab, size=value.count, only=frozenset(order))


def _wrap(
    tok: Tokenizer, origin: str, *, unk: int | None, special: Iterable[int] | None = None
) -> Vocab:
    ids = set(special or ())
    added = tok.get_added_tokens_decoder()
    ids.update(i for i, t in added.items() if t.special)
    size = tok.get_vocab_size(with_added_tokens=True)
    return Vocab(tok, size, frozenset(ids), unk, origin, added=frozenset(added))


def _unk_token(tok: Tokenizer) -> int | None:
    unk = getattr(tok.model, "unk_token", None)
    return tok.token_to_id(unk) if isinstance(unk, str) else None
