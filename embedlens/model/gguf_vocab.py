"""A GGUF file's tokenizer arrays (tokens, types, merges, scores) read from its metadata and
checked: strings in UTF-8, numbers as numbers, a kind of vocabulary embedlens rebuilds."""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from embedlens.errors import CheckpointError, UnsupportedError
from embedlens.io.gguf import GGUFHeader, LazyArray

if TYPE_CHECKING:
    pass


CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types

STRING = 8  # GGUF metadata value type of a string

_NUMBERS = frozenset({0, 1, 2, 3, 4, 5, 6, 10, 11, 12})  # GGUF integer and float types

_UNPACK = dict(zip(sorted(_NUMBERS), "BbHhIifQqd", strict=True))  # their struct codes

_SURROGATES = re.compile("[\udc80-\udcff]")  # bytes that were not UTF-8


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
    kind = gguf_kind(header)
    tokens = _string_array(header, "tokenizer.ggml.tokens")
    merges = _string_array(header, "tokenizer.ggml.merges")
    for i, merge in enumerate(merges or ()):
        if " " not in merge:
            raise corrupt(
                header,
                "tokenizer.ggml.merges",
                i,
                f"{merge!r} has no space between its two tokens",
            )
    types = _number_array(header, "tokenizer.ggml.token_type", int) or []
    scores = _number_array(header, "tokenizer.ggml.scores", float)
    return GGUFTokenizer(str(kind), tokens or [], [int(t) for t in types], merges, scores)


def checked_tokenizer(header: GGUFHeader) -> GGUFTokenizer:
    """`gguf_tokenizer`, of a kind embedlens rebuilds (`check_gguf_kind`)."""
    meta = gguf_tokenizer(header)
    check_gguf_kind(header, meta)
    return meta


def gguf_kind(header: GGUFHeader) -> str:
    """The GGUF tokenizer's model ('gpt2', 'llama', ...); UnsupportedError when it has none."""
    kind = header.metadata.get("tokenizer.ggml.model")
    if kind is None or header.metadata.get("tokenizer.ggml.tokens") is None:
        raise UnsupportedError(f"'{header.path.name}' carries no tokenizer in its metadata")
    return str(kind)


def unsupported_kind(header: GGUFHeader, kind: str) -> UnsupportedError:
    return UnsupportedError(
        f"'{header.path.name}' has a '{kind}' tokenizer; embedlens rebuilds 'gpt2' "
        "(byte-level BPE) and 'llama' (SentencePiece BPE) vocabularies from GGUF metadata",
        hint="use the model's folder with its tokenizer.json instead",
    )


def check_gguf_kind(header: GGUFHeader, meta: GGUFTokenizer) -> None:
    """UnsupportedError naming the file when embedlens does not rebuild its kind of vocabulary
    or it has nothing to build its merges from."""
    check_merges(header, meta.kind, meta.merges is not None, meta.scores is not None)
    if meta.kind not in ("gpt2", "llama"):
        raise unsupported_kind(header, meta.kind)


def check_merges(header: GGUFHeader, kind: str, merges: bool, scores: bool) -> None:
    """UnsupportedError naming the file when its BPE vocabulary has no merges to build from."""
    if kind == "gpt2" and not merges:
        what = "a byte-level vocabulary (tokenizer.ggml.model 'gpt2') without merges"
    elif kind == "llama" and not merges and not scores:
        what = "a SentencePiece vocabulary (tokenizer.ggml.model 'llama') with neither merges nor scores"
    else:
        return
    raise UnsupportedError(f"'{header.path.name}' has {what}: its tokenizer cannot be rebuilt")


def corrupt(header: GGUFHeader, key: str, index: int, what: str) -> CheckpointError:
    return CheckpointError(
        f"'{header.path.name}' has a corrupt tokenizer: {key}[{index}] {what}",
        hint="the GGUF file was written by a broken converter or damaged; fetch it again",
    )


def _string_array(header: GGUFHeader, key: str) -> list[str] | None:
    value = header.metadata.get(key)
    if value is None:
        return None
    bad: int | None = None
    if isinstance(value, LazyArray) and value.item_type == STRING:
        strings, bad = _strings(value)
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        strings = value
        bad = next((i for i, t in enumerate(strings) if _SURROGATES.search(t)), None)
    else:
        raise not_strings(header, key, value)
    if bad is not None:
        raw = strings[bad].encode("utf-8", "surrogateescape")
        raise corrupt(header, key, bad, f"{raw!r} is not valid UTF-8")
    return strings


def not_strings(header: GGUFHeader, key: str, value: object) -> CheckpointError:
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


def byte_level_merge_results(header: GGUFHeader) -> frozenset[str] | None:
    """Every piece a byte-level BPE GGUF's merges build ('a b' builds 'ab'), as the tokenizer
    vocab_from_gguf rebuilds applies them; None for another kind of vocabulary."""
    if header.metadata.get("tokenizer.ggml.model") != "gpt2":
        return None
    merges = _string_array(header, "tokenizer.ggml.merges")
    if merges is None:
        return None
    return frozenset(m.replace(" ", "", 1) for m in merges)


def numbers_at(header: GGUFHeader, key: str, ids: Iterable[int]) -> dict[int, Any]:
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


def _array(header: GGUFHeader, key: str) -> list[Any] | None:
    value = header.metadata.get(key)
    if isinstance(value, LazyArray):
        if value.item_type == STRING:
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
