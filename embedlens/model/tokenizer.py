"""A model's tokenizer without transformers: `tokenizers` over tokenizer.json or GGUF metadata.

`neighbors` and `addr` need three things from a tokenizer: encode a word without special tokens,
show one token's text, and know which ids are real tokens (below the tokenizer's length) and
which are special. The `tokenizers` library does all three in a fraction of the time transformers
takes to import. A GGUF file carries its vocabulary as metadata: byte-level BPE (`gpt2`) and
SentencePiece BPE (`llama`) vocabularies are rebuilt here the way transformers rebuilds them,
and kept built in embedlens' cache (tokenizer_cache): a 262k-piece vocabulary takes seconds to
rebuild.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from embedlens.errors import CheckpointError, UnsupportedError
from embedlens.io.gguf import GGUFHeader, LazyArray, read_gguf_header
from embedlens.io.source import ModelSource
from embedlens.model import tokenizer_cache
from embedlens.model.tokens import SPACE, byte_alphabet, outside_byte_alphabet, token_text
from embedlens.text import error_line

if TYPE_CHECKING:
    from tokenizers import Tokenizer

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_STRING = 8  # GGUF metadata value type of a string
_NUMBERS = frozenset({0, 1, 2, 3, 4, 5, 6, 10, 11, 12})  # GGUF integer and float types
_UNPACK = dict(zip(sorted(_NUMBERS), "BbHhIifQqd", strict=True))  # their struct codes

_SURROGATES = re.compile("[\udc80-\udcff]")  # bytes that were not UTF-8

# Split patterns for `tokenizer.ggml.pre` values whose merges were learned on a split other than
# GPT-2's (as transformers' GGUF loader sets them); any other value keeps GPT-2's byte-level split.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}


@dataclass(frozen=True)
class Vocab:
    """A loaded tokenizer and the facts about its ids that the table commands need."""

    tokenizer: Tokenizer
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
    _text: dict[int, str] = field(default_factory=dict, compare=False, repr=False)

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, no special tokens added (no BOS)."""
        self._whole()
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def _whole(self) -> None:
        if self.only is not None:
            raise ValueError("this vocabulary holds only some ids: it cannot read text")

    def piece(self, token_id: int) -> str | None:
        """The vocabulary entry as stored ('Ġking', '▁king'), or None outside the vocabulary."""
        return self.tokenizer.id_to_token(token_id)

    def text(self, token_id: int) -> str:
        """One token's exact decoded text, its bytes as \\xNN when it is a partial UTF-8 sequence."""
        if token_id in self._text:
            return self._text[token_id]
        piece = self.piece(token_id)
        decoded = self.tokenizer.decode([token_id], skip_special_tokens=False)
        shown = token_text(decoded, piece)
        self._text[token_id] = shown
        return shown

    def lookup(self, text: str) -> int | None:
        """The id of the vocabulary entry spelled exactly `text` (stored form), if there is one."""
        self._whole()
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


@dataclass(frozen=True)
class GGUFTokenizer:
    """The tokenizer arrays of a GGUF file's metadata, checked for type and encoding."""

    kind: str
    tokens: list[str]
    types: list[int]
    merges: list[str] | None
    scores: list[float] | None


def gguf_tokenizer(header: GGUFHeader) -> GGUFTokenizer:
    """Read and check a GGUF file's tokenizer arrays: CheckpointError naming the key and the
    entry when one is not what the format says (strings in UTF-8, merges as 'left right')."""
    kind = _gguf_kind(header)
    tokens = _string_array(header, "tokenizer.ggml.tokens")
    merges = _string_array(header, "tokenizer.ggml.merges")
    for i, merge in enumerate(merges or ()):
        if " " not in merge:
            raise _corrupt(
                header,
                "tokenizer.ggml.merges",
                i,
                f"{merge!r} has no space between its two tokens",
            )
    types = _number_array(header, "tokenizer.ggml.token_type", int) or []
    scores = _number_array(header, "tokenizer.ggml.scores", float)
    return GGUFTokenizer(str(kind), tokens or [], [int(t) for t in types], merges, scores)


def _gguf_kind(header: GGUFHeader) -> str:
    """The GGUF tokenizer's model ('gpt2', 'llama', ...); UnsupportedError when it has none."""
    kind = header.meta("tokenizer.ggml.model")
    if kind is None or header.metadata.get("tokenizer.ggml.tokens") is None:
        raise UnsupportedError(f"'{header.path.name}' carries no tokenizer in its metadata")
    return str(kind)


def _unsupported_kind(header: GGUFHeader, kind: str) -> UnsupportedError:
    return UnsupportedError(
        f"'{header.path.name}' has a '{kind}' tokenizer; embedlens rebuilds 'gpt2' "
        "(byte-level BPE) and 'llama' (SentencePiece BPE) vocabularies from GGUF metadata",
        hint="use the model's folder with its tokenizer.json instead",
    )


def _check_merges(header: GGUFHeader, kind: str, merges: bool, scores: bool) -> None:
    """UnsupportedError naming the file when its BPE vocabulary has no merges to build from."""
    if kind == "gpt2" and not merges:
        what = "a byte-level vocabulary (tokenizer.ggml.model 'gpt2') without merges"
    elif kind == "llama" and not merges and not scores:
        what = "a SentencePiece vocabulary (tokenizer.ggml.model 'llama') with neither merges nor scores"
    else:
        return
    raise UnsupportedError(f"'{header.path.name}' has {what}: its tokenizer cannot be rebuilt")


def _corrupt(header: GGUFHeader, key: str, index: int, what: str) -> CheckpointError:
    return CheckpointError(
        f"'{header.path.name}' has a corrupt tokenizer: {key}[{index}] {what}",
        hint="the GGUF file was written by a broken converter or damaged; fetch it again",
    )


def _string_array(header: GGUFHeader, key: str) -> list[str] | None:
    value = header.metadata.get(key)
    if value is None:
        return None
    bad: int | None = None
    if isinstance(value, LazyArray) and value.item_type == _STRING:
        strings, bad = _strings(value)
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        strings = value
        bad = next((i for i, t in enumerate(strings) if _SURROGATES.search(t)), None)
    else:
        raise _not_strings(header, key, value)
    if bad is not None:
        raw = strings[bad].encode("utf-8", "surrogateescape")
        raise _corrupt(header, key, bad, f"{raw!r} is not valid UTF-8")
    return strings


def _not_strings(header: GGUFHeader, key: str, value: object) -> CheckpointError:
    return CheckpointError(
        f"'{header.path.name}' has a corrupt tokenizer: {key} is {_kind(value)}, not a list "
        "of strings"
    )


def _number_array(header: GGUFHeader, key: str, kind: type) -> list[Any] | None:
    stored = header.metadata.get(key)
    value = _array(header, key)
    if value is None:
        return None
    numeric = isinstance(stored, LazyArray) and stored.item_type in _UNPACK
    if not numeric and not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in value
    ):
        raise CheckpointError(
            f"'{header.path.name}' has a corrupt tokenizer: {key} is {_kind(value)}, not a list "
            f"of numbers"
        )
    return value


def _kind(value: object) -> str:
    if isinstance(value, LazyArray):
        return f"an array of GGUF type {value.item_type}"
    if isinstance(value, list):
        kinds = sorted({type(v).__name__ for v in value})
        return f"a list of {', '.join(kinds) or 'nothing'}"
    return f"a {type(value).__name__}"


def vocab_from_gguf(header: GGUFHeader) -> Vocab:
    """Rebuild the tokenizer a GGUF file describes (byte-level or SentencePiece BPE), or load
    the one built before from the same metadata (tokenizer_cache)."""
    meta = gguf_tokenizer(header)
    kind, tokens, types, merges = meta.kind, meta.tokens, meta.types, meta.merges
    _check_merges(header, kind, merges is not None, meta.scores is not None)
    if kind not in ("gpt2", "llama"):
        raise _unsupported_kind(header, kind)
    spelled = _byte_alphabet_spelling(tokens) if kind == "gpt2" else tokens
    key = tokenizer_cache.tokenizer_key(header)
    tok = tokenizer_cache.load(key)
    if tok is None:
        tok = _build_gguf_tokenizer(header, meta, spelled)
        tokenizer_cache.store(key, tok)
    unk = header.meta("tokenizer.ggml.unknown_token_id")
    special = {i for i, t in enumerate(types) if t == _CONTROL}
    vocab = _wrap(tok, "GGUF metadata", unk=unk if isinstance(unk, int) else None, special=special)
    return replace(vocab, pieces=_stored_pieces(spelled, vocab.size))


def _build_gguf_tokenizer(header: GGUFHeader, meta: GGUFTokenizer, spelled: list[str]) -> Tokenizer:
    """The tokenizer of a GGUF vocabulary ('gpt2' or 'llama'), built from its arrays; a
    CheckpointError when the Rust side finds them inconsistent."""
    try:
        if meta.kind == "gpt2":
            tok = _byte_level(spelled, meta.merges, header.meta("tokenizer.ggml.pre"))
        else:
            add_space = header.meta("tokenizer.ggml.add_space_prefix", True)
            tok = _sentencepiece(meta.tokens, meta.merges, meta.scores, add_space=bool(add_space))
        _add_gguf_tokens(tok, meta.tokens, meta.types, byte_level=meta.kind == "gpt2")
    except (UnsupportedError, CheckpointError):
        raise
    except Exception as e:  # the Rust side raises bare Exceptions on inconsistent vocabularies
        raise CheckpointError(
            f"'{header.path.name}' has a corrupt tokenizer: {error_line(e)}"
        ) from e
    return tok


def _stored_pieces(spelled: list[str], size: int) -> tuple[str | None, ...]:
    """What get_vocab gives by id for a vocabulary built from these entries: each entry at its
    first id (a repeated entry's later ids have none), ids from `size` on left out."""
    if len(set(spelled)) == len(spelled):  # no entry repeated: each at its own id
        pieces: list[str | None] = list(spelled[:size])
    else:
        first = _first_ids(spelled)
        pieces = [t if first[t] == i else None for i, t in enumerate(spelled[:size])]
    return tuple(pieces + [None] * (size - len(pieces)))


def _first_ids(tokens: list[str]) -> dict[str, int]:
    """Each entry's first id (a repeated entry's later ids lose), built at C speed."""
    return dict(zip(reversed(tokens), range(len(tokens) - 1, -1, -1), strict=True))


def byte_level_merge_results(header: GGUFHeader) -> frozenset[str] | None:
    """Every piece a byte-level BPE GGUF's merges build ('a b' builds 'ab'), as the tokenizer
    vocab_from_gguf rebuilds applies them; None for another kind of vocabulary."""
    if header.meta("tokenizer.ggml.model") != "gpt2":
        return None
    merges = _string_array(header, "tokenizer.ggml.merges")
    if merges is None:
        return None
    return frozenset(m.replace(" ", "", 1) for m in merges)


def gguf_rows_vocab(header: GGUFHeader, ids: Iterable[int]) -> Vocab:
    """A GGUF vocabulary that shows just the given ids, their pieces read straight from the
    token array: rebuilding a 262k-token tokenizer takes a second, this a few milliseconds.
    Each token is decoded by a tokenizer holding only the asked pieces, built as
    vocab_from_gguf builds the whole one, so its text is the same. A short vocabulary is
    loaded whole (vocab_from_gguf)."""
    kind = _gguf_kind(header)
    value = header.metadata["tokenizer.ggml.tokens"]
    if not isinstance(value, LazyArray):
        return vocab_from_gguf(header)
    if value.item_type != _STRING:
        raise _not_strings(header, "tokenizer.ggml.tokens", value)
    if kind not in ("gpt2", "llama"):
        raise _unsupported_kind(header, kind)
    merges = header.metadata.get("tokenizer.ggml.merges")
    _check_merges(header, kind, merges is not None, "tokenizer.ggml.scores" in header.metadata)
    if isinstance(merges, LazyArray) and merges.item_type != _STRING:
        raise _not_strings(header, "tokenizer.ggml.merges", merges)
    types = _numbers_at(header, "tokenizer.ggml.token_type", ids)
    _numbers_at(header, "tokenizer.ggml.scores", ())
    pieces: dict[int, str] = {}
    for i, raw in value.items_at(ids).items():
        try:
            pieces[i] = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _corrupt(
                header, "tokenizer.ggml.tokens", i, f"{raw!r} is not valid UTF-8"
            ) from None
    order = sorted(pieces)
    tokens = [pieces[i] for i in order]
    kinds = [int(types.get(i, 0)) for i in order]
    try:
        tok = _partial_tokenizer(dict(zip(tokens, order, strict=True)), byte_level=kind == "gpt2")
        _add_gguf_tokens(tok, tokens, kinds, byte_level=kind == "gpt2")
    except Exception as e:  # the Rust side raises bare Exceptions on inconsistent vocabularies
        raise CheckpointError(
            f"'{header.path.name}' has a corrupt tokenizer: {error_line(e)}"
        ) from e
    unk = header.meta("tokenizer.ggml.unknown_token_id")
    special = {i for i, t in zip(order, kinds, strict=True) if t == _CONTROL}
    vocab = _wrap(tok, "GGUF metadata", unk=unk if isinstance(unk, int) else None, special=special)
    return replace(vocab, size=value.count, only=frozenset(order))


def _numbers_at(header: GGUFHeader, key: str, ids: Iterable[int]) -> dict[int, Any]:
    """The given items of a numeric array (token types, scores), checked as _number_array
    checks the whole one."""
    value = header.metadata.get(key)
    if value is None:
        return {}
    if not isinstance(value, LazyArray):
        numbers = _number_array(header, key, float) or []
        return {i: numbers[i] for i in ids if 0 <= i < len(numbers)}
    if value.item_type not in _NUMBERS:
        raise CheckpointError(
            f"'{header.path.name}' has a corrupt tokenizer: {key} is {_kind(value)}, not a list "
            f"of numbers"
        )
    return value.items_at(ids)


def _partial_tokenizer(vocab: dict[str, int], *, byte_level: bool) -> Tokenizer:
    """A tokenizer of just these pieces (ids kept), decoding as the whole one decodes."""
    from tokenizers import Tokenizer, models

    if byte_level:
        spelling = byte_alphabet()
        alphabet = set(spelling.values())
        vocab = {_respelled(t, spelling, alphabet): i for t, i in vocab.items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.decoder = _byte_level_decoder() if byte_level else _sentencepiece_decoder()
    return tok


def _wrap(
    tok: Tokenizer, origin: str, *, unk: int | None, special: Iterable[int] | None = None
) -> Vocab:
    ids = set(special or ())
    ids.update(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    size = tok.get_vocab_size(with_added_tokens=True)
    return Vocab(tok, size, frozenset(ids), unk, origin)


def _unk_token(tok: Tokenizer) -> int | None:
    unk = getattr(tok.model, "unk_token", None)
    return tok.token_to_id(unk) if isinstance(unk, str) else None


def _array(header: GGUFHeader, key: str) -> list[Any] | None:
    value = header.metadata.get(key)
    if isinstance(value, LazyArray):
        if value.item_type == _STRING:
            return _strings(value)[0]
        return _numbers(value) if value.item_type in _UNPACK else value.read()
    return list(value) if isinstance(value, list) else None


def _numbers(array: LazyArray) -> list[Any]:
    """A long numeric array (scores, token types) unpacked in one call, as LazyArray.read
    would decode it item by item (0.1 s, not 1.5 s, at 262k items)."""
    code = _UNPACK[array.item_type]
    width = struct.calcsize("<" + code)
    if array.end - array.start != array.count * width:
        return array.read()  # its own error names what is wrong
    with open(array.path, "rb") as fh:
        fh.seek(array.start)
        buf = fh.read(array.end - array.start)
    if len(buf) != array.count * width:
        return array.read()
    return list(struct.unpack(f"<{array.count}{code}", buf))


def _strings(array: LazyArray) -> tuple[list[str], int | None]:
    """A long string array (tokens, merges), decoded in one tight loop; with it the index of
    the first string that is not UTF-8 (kept with its bytes as surrogates), if any."""
    with open(array.path, "rb") as fh:
        fh.seek(array.start)
        buf = fh.read(array.end - array.start)
    out: list[str] = []
    bad: int | None = None
    pos, unpack = 0, struct.unpack_from
    for i in range(array.count):
        (n,) = unpack("<Q", buf, pos)
        pos += 8
        raw = buf[pos : pos + n]
        try:
            out.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            out.append(raw.decode("utf-8", "surrogateescape"))
            bad = i if bad is None else bad
        pos += n
    if pos != len(buf):
        raise CheckpointError(f"'{array.path.name}' has a corrupt string array in its metadata")
    return out, bad


def _byte_level(tokens: list[str], merges: list[str] | None, pre: object) -> Tokenizer:
    """A byte-level BPE tokenizer of these tokens (spelled in the byte alphabet)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    assert merges is not None, "vocab_from_gguf checks that a byte-level vocabulary has merges"
    vocab = _first_ids(tokens)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False)  # type: ignore[arg-type]
    tok = Tokenizer(bpe)
    split = _GGUF_SPLITS.get(str(pre))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = _byte_level_decoder()
    return tok


def _byte_alphabet_spelling(tokens: list[str]) -> list[str]:
    """The tokens in the byte alphabet: those stored as text respelled."""
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    spelled = list(tokens)
    for i in outside_byte_alphabet(tokens):
        spelled[i] = _respelled(tokens[i], spelling, alphabet)
    return spelled


def _respelled(token: str, spelling: dict[int, str], alphabet: set[str]) -> str:
    """A byte-level token in the byte alphabet: a token stored as text is respelled."""
    if set(token) <= alphabet:
        return token
    return "".join(spelling[b] for b in token.encode("utf-8", "surrogateescape"))


def _byte_level_decoder() -> Any:
    from tokenizers import decoders

    return decoders.ByteLevel()


def _sentencepiece_decoder() -> Any:
    from tokenizers import decoders

    return decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )


def _sentencepiece(
    tokens: list[str],
    merges: list[str] | None,
    scores: list[float] | None,
    *,
    add_space: bool,
) -> Tokenizer:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = _first_ids(tokens)
    if merges is not None:
        pairs = [_merge_pair(m) for m in merges]
    else:
        assert scores is not None, "vocab_from_gguf checks for merges or scores"
        pairs = _merges_from_scores(vocab, dict(zip(tokens, scores, strict=False)))
    unk = "<unk>" if "<unk>" in vocab else None
    bpe = models.BPE(
        vocab=vocab,
        merges=pairs,
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPACE, prepend_scheme="first" if add_space else "never", split=False
    )
    tok.decoder = _sentencepiece_decoder()
    return tok


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a scored vocabulary: every split of a token into two tokens,
    best-scored token first (what transformers' generate_merges does)."""
    found: list[tuple[str, str, float]] = []
    for merged, score in scores.items():
        local = [
            (merged[:i], merged[i:], score)
            for i in range(1, len(merged))
            if merged[:i] in vocab and merged[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found.extend(local)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def _add_gguf_tokens(
    tok: Tokenizer, tokens: list[str], types: list[int], *, byte_level: bool
) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens."""
    from tokenizers import AddedToken

    alphabet = set(byte_alphabet().values()) if byte_level else None
    control = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == _CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    if control:
        tok.add_special_tokens(control)
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == _USER_DEFINED and tok.token_to_id(t) is not None
    ]
    if user:
        tok.add_tokens(user)


def _merge_pair(merge: str) -> tuple[str, str]:
    """A merge rule 'a b' as ('a', 'b')."""
    left, _, right = merge.partition(" ")
    return left, right
