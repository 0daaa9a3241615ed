"""Text for tuning, streamed: documents from a file, tokenised into sequences of equal length,
shared out as the run reads them (`plan_sequences`: fitted, refined on, checked, held out).

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
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embedlens.errors import SourceError, UsageError

MAX_DOCUMENT = 1 << 20
"""Characters of text tokenised at once: a longer document is read (and tokenised) in pieces."""
CHECK_BYTES_PER_TOKEN = 32
"""`check_file` reads the file up to this many bytes per token asked for (or to its end)."""
SEQ_LEN = 512
"""The longest default sequence: longer ones cost memory (a [seq_len, V] float32 array of the
model's logits) and add little; the model's context when it is shorter."""


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


@dataclass(frozen=True)
class Plan:
    """The data as run: sequences to fit, to refine on (a seeded share of those), to hold out."""

    seq_len: int
    fit: Sequences
    refine: Sequences
    check: Sequences
    """A fitted sequence the refinement does not read, to keep each refined translator only
    where it does better than its start."""
    held_out: Sequences
    notes: list[str]
    fit_tokens: int
    refine_rows: int
    """Rows (tokens) the refinement reads: --refine-tokens, at most those of `refine`."""
    eval_tokens: int
    eval_bytes: float
    """The UTF-8 bytes of text behind the held-out tokens."""


def plan_sequences(
    tokenizer: Any,
    config: Any,
    files: tuple[Path, Path | None],
    seq_len: int | None,
    counts: tuple[int, int, int],
    seed: int,
) -> Plan:
    """Tokenise the data into the sequences the run needs (before the weights load): `files`,
    --data and --eval (None: the tail of --data); `counts`, --tokens, --eval-tokens and
    --refine-tokens; `seed`, the refinement's choice of sequences. On a GGUF, the first texts'
    ids are checked against the file's own tokenizer."""
    from embedlens.model import file_tokens

    data, eval_file = files
    tokens, eval_tokens, refine_tokens = counts
    context = _context(config)
    seq_len, note = resolve_seq_len(seq_len, context, min(tokens, eval_tokens))
    sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id

    checked = [0]

    def tokenize(text: str) -> list[int]:
        ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
        if checked[0] < file_tokens.CHECKED_TEXTS:  # a GGUF's own reading of the first texts
            checked[0] += 1
            file_tokens.check_ids(text, False, ids)
        return ids

    n_fit, n_eval = tokens // seq_len, eval_tokens // seq_len
    notes = [] if note is None else [note]
    if eval_file is None:
        stream = read_sequences(data, tokenize, sep, seq_len, n_fit + n_eval)
        fit, held_out = _split(stream, n_fit, n_eval, data, notes)
    else:
        fit = read_sequences(data, tokenize, sep, seq_len, n_fit)
        held_out = read_sequences(eval_file, tokenize, sep, seq_len, n_eval, "--eval")
        for what, got, want in (("--data", fit, n_fit), ("--eval", held_out, n_eval)):
            _enough(what, got, want, seq_len, notes)
    refine, check = _refine_share(fit, refine_tokens, seed)
    refine_rows = min(refine_tokens, refine.tokens)
    return Plan(seq_len, fit, refine, check, held_out, notes, fit.tokens, refine_rows,
                held_out.tokens, sum(held_out.text_bytes))  # fmt: skip


def resolve_seq_len(asked: int | None, context: int | None, tokens: int) -> tuple[int, str | None]:
    """The sequence length to use, and a note saying how it was chosen (None when asked);
    `tokens`: the fewest tokens a part of the data is asked for (--tokens, --eval-tokens)."""
    if asked is not None:
        if context is not None and asked > context:
            raise UsageError(
                f"--seq-len {asked:,} is longer than the model's context ({context:,} tokens)"
            )
        return asked, None
    if tokens < min(SEQ_LEN, context or SEQ_LEN):
        return tokens, f"sequences of {tokens:,} tokens: all --tokens or --eval-tokens ask for"
    if context is not None and context < SEQ_LEN:
        return context, f"sequences of {context:,} tokens: the model's context (--seq-len)"
    where = f"; the model's context is {context:,}" if context is not None else ""
    return SEQ_LEN, (
        f"sequences of {SEQ_LEN:,} tokens (--seq-len; longer ones hold a larger "
        f"[tokens x vocabulary] array of logits in memory{where})"
    )


def _context(config: Any) -> int | None:
    """The model's context length in tokens, if its config gives one."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    context = getattr(text, "max_position_embeddings", None)
    return context if isinstance(context, int) and not isinstance(context, bool) else None


def _split(
    stream: Sequences, n_fit: int, n_eval: int, data: Path, notes: list[str]
) -> tuple[Sequences, Sequences]:
    """The data's sequences fitted, and its tail held out (a tenth of it, at least one
    sequence, when the data hold fewer than asked)."""
    have = len(stream)
    if have < 2:
        raise UsageError(
            f"--data '{data}' holds too little text: not one sequence of {stream.seq_len:,} "
            "tokens to fit and one to hold out",
            hint="give more text, a smaller --seq-len, or --eval FILE",
        )
    if have < n_fit + n_eval:
        n_eval = min(n_eval, max(1, have // 10))
        n_fit = have - n_eval
        notes.append(
            f"--data holds {have * stream.seq_len:,} tokens (in sequences of {stream.seq_len:,}), "
            f"fewer than --tokens and --eval-tokens ask: fitted on {n_fit * stream.seq_len:,}, "
            f"held out the last {n_eval * stream.seq_len:,}"
        )
    return stream.part(0, n_fit), stream.part(n_fit, n_fit + n_eval)


def _enough(what: str, got: Sequences, want: int, seq_len: int, notes: list[str]) -> None:
    if len(got) == 0:
        raise UsageError(
            f"{what} holds too little text: not one sequence of {seq_len:,} tokens",
            hint="give more text, or a smaller --seq-len",
        )
    if len(got) < want:
        notes.append(f"{what} holds only {got.tokens:,} tokens (in sequences of {seq_len:,})")


def _refine_share(fit: Sequences, tokens: int, seed: int) -> tuple[Sequences, Sequences]:
    """The sequences the refinement reads (a seeded choice among those fitted), and the one it
    checks its translators on: the next in that order (with a single sequence, that one)."""
    if tokens == 0:
        return fit.part(0, 0), fit.part(0, 0)
    order = list(range(len(fit)))
    random.Random(seed).shuffle(order)
    count = min(len(fit), -(-tokens // fit.seq_len))
    chosen, check = Sequences(fit.seq_len), Sequences(fit.seq_len)
    for i in order[:count]:
        chosen.add(fit.ids[i], fit.text_tokens[i], fit.text_bytes[i])
    i = order[count] if count < len(order) else order[-1]
    check.add(fit.ids[i], fit.text_tokens[i], fit.text_bytes[i])
    return chosen, check
