"""Text for tuning, streamed: documents from a file, tokenised into sequences of equal length.

A data file is JSON Lines when its first non-blank line starts with `{` (each line an object
with a `text` string; other keys are ignored), else UTF-8 text whose documents are separated by
blank lines. Documents are joined as tuned-lens joins them: each one after a separator token
(the tokenizer's end-of-sequence token, else its beginning-of-sequence token), the stream cut into
sequences of `seq_len` tokens; a last, shorter piece is dropped. The file is read one line at a
time and no further than the tokens asked for.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from embedlens.errors import SourceError, UsageError

MAX_DOCUMENT = 1 << 20
"""Characters of text tokenised at once: a longer document is read (and tokenised) in pieces."""
CHECK_BYTES_PER_TOKEN = 32
"""`check_file` reads the file up to this many bytes per token asked for (or to its end)."""


@dataclass(frozen=True)
class Document:
    """A document's text, where it starts, and whether it continues the one before (a long
    document read in pieces: no separator between them)."""

    line: int
    text: str
    continued: bool = False


def documents(path: Path, option: str = "--data") -> Iterator[Document]:
    """The file's documents in order (UsageError naming the line of one that is not text, or
    of a JSON Lines line that holds no `text` string)."""
    mode: bool | None = None
    lines: list[str] = []
    start, size, continued = 0, 0, False
    for n, raw in _lines(path, option):
        try:
            text = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError:
            raise UsageError(f"{option} '{path}' line {n}: not UTF-8 text") from None
        if mode is None and text.strip():
            mode = text.lstrip().startswith("{")
        if mode:
            if text.strip():
                yield Document(n, _json_text(text, n, path, option))
            continue
        if not text.strip():
            if lines:
                yield Document(start, "\n".join(lines), continued)
            lines, size, continued = [], 0, False
            continue
        if not lines:
            start = n
        lines.append(text)
        size += len(text) + 1
        if size >= MAX_DOCUMENT:
            yield Document(start, "\n".join(lines), continued)
            lines, size, continued = [], 0, True
    if lines:
        yield Document(start, "\n".join(lines), continued)


def _lines(path: Path, option: str) -> Iterator[tuple[int, bytes]]:
    try:
        with open(path, "rb") as fh:
            yield from enumerate(fh, 1)
    except OSError as e:
        raise SourceError(f"cannot read {option} '{path}': {e.strerror or e}") from None


def _json_text(text: str, n: int, path: Path, option: str) -> str:
    where = f"{option} '{path}' line {n}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(value, dict) or not isinstance(value.get("text"), str):
        raise UsageError(
            f"{where}: a JSON Lines data file holds objects with a 'text' string",
            hint='write one {"text": "..."} per line, or plain text with blank lines between '
            "documents",
        )
    return str(value["text"])


def check_file(path: Path, tokens: int, option: str = "--data") -> None:
    """What can be checked without a tokenizer: the file exists and reads as documents, up to
    about CHECK_BYTES_PER_TOKEN bytes per token asked for (the rest is checked as it is read)."""
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise UsageError(
            f"{option} '{path}' {what}",
            hint="name a UTF-8 text file (blank lines between documents) or JSON Lines with "
            "a 'text' field",
        )
    budget, seen, any_text = tokens * CHECK_BYTES_PER_TOKEN, 0, False
    for doc in documents(path, option):
        any_text = any_text or bool(doc.text.strip())
        seen += len(doc.text)
        if seen >= budget:
            break
    if not any_text:
        raise UsageError(f"{option} '{path}' holds no text")


@dataclass
class Sequences:
    """Token sequences of equal length, with the text's bytes behind each (for bits per byte)."""

    seq_len: int
    ids: list[list[int]] = field(default_factory=list)
    text_tokens: list[int] = field(default_factory=list)
    """Per sequence: its tokens that come from text (not separators)."""
    text_bytes: list[float] = field(default_factory=list)
    """Per sequence: the UTF-8 bytes of text behind them (a document's bytes shared evenly
    among its tokens)."""

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, ids: list[int], text_tokens: int, text_bytes: float) -> None:
        """One more sequence."""
        self.ids.append(ids)
        self.text_tokens.append(text_tokens)
        self.text_bytes.append(text_bytes)

    def part(self, start: int, stop: int | None = None) -> Sequences:
        """Sequences start..stop, with their byte counts."""
        sl = slice(start, stop)
        return Sequences(self.seq_len, self.ids[sl], self.text_tokens[sl], self.text_bytes[sl])

    @property
    def tokens(self) -> int:
        return len(self.ids) * self.seq_len

    def tokens_per_byte(self) -> float:
        """Text tokens per UTF-8 byte of their text (the ratio bits per byte are taken with)."""
        total = sum(self.text_bytes)
        return sum(self.text_tokens) / total if total > 0 else math.nan


def read_sequences(
    path: Path,
    tokenize: Callable[[str], list[int]],
    separator: int | None,
    seq_len: int,
    count: int,
    option: str = "--data",
) -> Sequences:
    """The first `count` sequences of `seq_len` tokens of the file (fewer when it ends first)."""
    out = Sequences(seq_len)
    current: list[int] = []
    counts = [0, 0.0]  # the current sequence's text tokens and their bytes
    for doc in documents(path, option):
        if len(out) >= count:
            break
        ids = tokenize(doc.text)
        if not ids:
            continue
        per_token = len(doc.text.encode("utf-8")) / len(ids)
        lead = [] if separator is None or doc.continued else [separator]
        for i, is_text in [(s, False) for s in lead] + [(t, True) for t in ids]:
            current.append(i)
            counts[0] += is_text
            counts[1] += per_token if is_text else 0.0
            if len(current) == seq_len:
                out.add(current, int(counts[0]), counts[1])
                current, counts = [], [0, 0.0]
                if len(out) >= count:
                    break
    return out
