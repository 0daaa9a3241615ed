"""A GGUF vocabulary that reads a few words without building its whole tokenizer.

Building the tokenizer of a 262,144-piece SentencePiece vocabulary (Gemma 3) takes seconds, and
loading it back from the tokenizer cache still takes a few; `addr` and `neighbors` read a word or
two. BPE builds a word only out of pieces that are substrings of it (after the pre-tokenizer:
'▁' for a space, the byte alphabet), so a tokenizer of those pieces alone, built as the whole one
is (the same ids, the merges among them in the same order, the same added tokens), encodes it to
the same ids: `WordReader` builds one for each text it reads, and shows a token with a tokenizer of
that piece alone (as `gguf_rows_vocab` does). The arrays are read and checked as for the whole
tokenizer; an id the arrays cannot answer for alone (a repeated entry) asks the whole tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from embedlens.io.gguf import GGUFHeader, read_gguf_header
from embedlens.io.source import ModelSource
from embedlens.model import gguf_vocab as gv
from embedlens.model import tokenizer as tk
from embedlens.model import tokens as tb
from embedlens.model.tokens import SPACE, byte_alphabet

if TYPE_CHECKING:
    from tokenizers import Tokenizer

MAX_CHARS = 200
"""A longer text is read with the whole tokenizer (its substrings grow as its square)."""


def words_vocab(source: ModelSource, gguf: GGUFHeader | None = None) -> tk.Vocab:
    """The model's vocabulary for reading a few words: a GGUF file's (gguf_words_vocab), else
    its tokenizer.json (load_vocab)."""
    if not source.is_gguf:
        return tk.load_vocab(source)
    assert source.path is not None
    return gguf_words_vocab(gguf or read_gguf_header(source.path))


def gguf_words_vocab(header: GGUFHeader) -> tk.Vocab:
    """The vocabulary of a GGUF file, reading text with `WordReader` (its tokenizer built only
    if something else asks for it, its stored entries with it): the size, special, added and
    unknown ids of the whole one."""
    meta = gv.checked_tokenizer(header)
    byte_level = meta.kind == "gpt2"
    spelled = tb.byte_alphabet_spelling(meta.tokens) if byte_level else meta.tokens
    first = tb.first_ids(spelled)
    if meta.merges is not None and not _merges_hold(meta.merges, first):
        return tk.vocab_from_gguf(header)  # the whole tokenizer's own error, or its answer
    reader = WordReader(header, meta, spelled, first, byte_level)
    control, user = reader.added_tokens()
    special = {i for i, t in enumerate(meta.types) if t == gv.CONTROL} | control
    unk = header.metadata.get("tokenizer.ggml.unknown_token_id")
    return tk.Vocab(
        None,
        len(first),
        frozenset(special),
        unk if isinstance(unk, int) else None,
        tk.GGUF_ORIGIN,
        added=frozenset(control | user),
        loads=reader.whole,
        reader=reader,
    )


def _merges_hold(merges: list[str], first: dict[str, int]) -> bool:
    """Whether every merge joins two entries into a third (else the whole build refuses)."""
    for merge in merges:
        left, _, right = merge.partition(" ")
        if left not in first or right not in first or left + right not in first:
            return False
    return True


@dataclass
class WordReader:
    """Encodes and looks up text with a tokenizer of the pieces it can use, and shows a token
    with a tokenizer of that piece alone."""

    header: GGUFHeader
    meta: gv.GGUFTokenizer
    spelled: list[str]
    first: dict[str, int]
    byte_level: bool
    _built: dict[str, Tokenizer] = field(default_factory=dict)
    _whole: list[tk.Vocab] = field(default_factory=list)
    _scores: dict[str, float] | None = None
    _results: list[str] | None = None

    def whole(self) -> tk.Vocab:
        """The whole vocabulary (built, or loaded from the tokenizer cache) once."""
        if not self._whole:
            self._whole.append(tk.vocab_from_gguf(self.header))
        return self._whole[0]

    def added_tokens(self) -> tuple[set[int], set[int]]:
        """The ids of the control and of the user-defined tokens the whole build adds."""
        alphabet = set(byte_alphabet().values()) if self.byte_level else None
        tokens, marked = self.meta.tokens, (gv.CONTROL, gv.USER_DEFINED)
        ids = [i for i, kind in enumerate(self.meta.types) if kind in marked and i < len(tokens)]
        control = {
            self.first[tokens[i]]
            for i in ids
            if self.meta.types[i] == gv.CONTROL and (alphabet is None or set(tokens[i]) <= alphabet)
        }
        user = {
            self.first[tokens[i]]
            for i in ids
            if self.meta.types[i] == gv.USER_DEFINED and tokens[i] in self.first
        }
        return control, user

    def encode(self, text: str) -> list[int]:
        return list(self._for(text).encode(text, add_special_tokens=False).ids)

    def lookup(self, text: str) -> int | None:
        found: int | None = self._for(text).token_to_id(text)
        return found

    def piece(self, token_id: int) -> str | None:
        if 0 <= token_id < len(self.spelled):
            piece = self.spelled[token_id]
            if self.first[piece] == token_id:
                return piece
        return self.whole().piece(token_id)

    def decode(self, token_id: int) -> str:
        if not (0 <= token_id < len(self.spelled)) or self.piece(token_id) is None:
            return str(self.whole().tokenizer.decode([token_id], skip_special_tokens=False))
        raw, kind = self.meta.tokens[token_id], self._kind(token_id)
        tok = tb.partial_tokenizer({raw: token_id}, byte_level=self.byte_level)
        tb.add_gguf_tokens(tok, [raw], [kind], byte_level=self.byte_level)
        return str(tok.decode([token_id], skip_special_tokens=False))

    def _kind(self, token_id: int) -> int:
        types = self.meta.types
        return int(types[token_id]) if token_id < len(types) else 0

    def _for(self, text: str) -> Tokenizer:
        """A tokenizer of the pieces `text` can be built from (the whole one for a long text)."""
        if len(text) > MAX_CHARS:
            return self.whole().tokenizer
        if text not in self._built:
            try:
                self._built[text] = self._build(self._pieces(text))
            except Exception:  # the Rust side on what the whole build would refuse: its error
                return self.whole().tokenizer
        return self._built[text]

    def _pieces(self, text: str) -> dict[str, int]:
        """Every entry that is a substring of the text as the pre-tokenizer may give it, with its
        id, in id order; for SentencePiece also the byte pieces and '<unk>' (its fallbacks)."""
        if self.byte_level:
            spelling = byte_alphabet()
            forms = [text, "".join(spelling[b] for b in text.encode("utf-8", "surrogateescape"))]
            candidates = set().union(*map(_substrings, forms))
        else:
            spaced = text.replace(" ", SPACE)
            inner = _substrings(spaced)
            candidates = _substrings(text) | inner | {SPACE + s for s in inner} | {SPACE}
            candidates |= {f"<0x{b:02X}>" for b in range(256)} | {"<unk>"}
        found = {c: self.first[c] for c in candidates if c in self.first}
        return dict(sorted(found.items(), key=lambda item: item[1]))

    def _build(self, pieces: dict[str, int]) -> Tokenizer:
        """The whole build's tokenizer (tokens.build_gguf_tokenizer) over these pieces."""
        meta = self.meta
        merges = self._merges(pieces)
        if self.byte_level:
            assert merges is not None, "a byte-level vocabulary has merges (checked)"
            tok = tb.byte_level_tokenizer(
                pieces, merges, self.header.metadata.get("tokenizer.ggml.pre")
            )
        else:
            add_space = bool(self.header.metadata.get("tokenizer.ggml.add_space_prefix", True))
            scores = None if merges is not None else self._scores_of(pieces)
            tok = tb.sentencepiece_tokenizer(pieces, merges, scores, add_space=add_space)
        ids = self._ids_of(pieces)
        tb.add_gguf_tokens(
            tok,
            [meta.tokens[i] for i in ids],
            [self._kind(i) for i in ids],
            byte_level=self.byte_level,
        )
        return tok

    def _merges(self, pieces: dict[str, int]) -> list[str] | None:
        """The merges that build one of `pieces`, in their order."""
        merges = self.meta.merges
        if merges is None:
            return None
        if self._results is None:
            self._results = [m.replace(" ", "", 1) for m in merges]
        return [m for m, built in zip(merges, self._results, strict=True) if built in pieces]

    def _scores_of(self, pieces: dict[str, int]) -> dict[str, float]:
        """The pieces' scores as the whole build takes them: dict(zip(tokens, scores)), an
        entry's last score at its first place."""
        scores = self.meta.scores or []
        if len(self.first) == len(self.spelled):  # no entry repeated: each its own score
            return {p: scores[i] for p, i in pieces.items() if i < len(scores)}
        if self._scores is None:
            self._scores = dict(zip(self.meta.tokens, scores, strict=False))
        every = self._scores
        return {p: every[p] for p in pieces if p in every}

    def _ids_of(self, pieces: dict[str, int]) -> list[int]:
        """Every id of these entries (a repeated entry's later ids too), in order."""
        if len(self.first) == len(self.spelled):
            return list(pieces.values())
        return [i for i, p in enumerate(self.spelled) if p in pieces]


def _substrings(text: str) -> set[str]:
    n = len(text)
    return {text[i:j] for i in range(n) for j in range(i + 1, n + 1)}
