"""The text of `lens --text`: read and refused before any model loads, tokenised once, and cut
into windows (llama-perplexity's rule)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from embedlens.errors import UsageError

SCORES = ("half", "all")


@dataclass(frozen=True)
class Rule:
    """How the text is cut and scored."""

    ctx: int
    stride: int
    score: str
    max_tokens: int | None

    def scored(self) -> list[int]:
        """The positions j of a window whose prediction of token j+1 is scored: 'all' every one;
        'half' the second half (j from ctx/2, as llama-perplexity scores), or with a --stride
        below ctx/2 the last `stride` predictions (its --ppl-stride rule): each token once."""
        if self.score == "all":
            return list(range(self.ctx - 1))
        first = max(self.ctx // 2, self.ctx - 1 - self.stride)
        return list(range(first, self.ctx - 1))

    def starts(self, n_tokens: int) -> list[int]:
        """Where each window starts: every `stride` tokens while a whole window fits."""
        return list(range(0, n_tokens - self.ctx + 1, self.stride))


def rule(ctx: int, stride: int | None, score: str, max_tokens: int | None) -> Rule:
    """The options checked."""
    if isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 4:
        raise UsageError(f"--ctx {ctx}: give a window of at least 4 tokens")
    step = ctx if stride is None else stride
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise UsageError(f"--stride {stride}: give a number of tokens above 0")
    if score not in SCORES:
        raise UsageError(f"--score {score!r}: use half or all")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < ctx):
        raise UsageError(f"--max-tokens {max_tokens}: give at least one window (--ctx {ctx})")
    return Rule(ctx, step, score, max_tokens)


def read_text(path: str | os.PathLike[str]) -> str:
    """The file's text; a file that is missing, not UTF-8 text, or empty is refused."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise UsageError(f"--text {name}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"--text {name} is a folder, not a text file") from None
    except OSError as e:
        raise UsageError(f"--text {name} cannot be read: {e.strerror or e}") from None
    if b"\0" in data:
        raise UsageError(f"--text {name} is not text (it holds NUL bytes)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"--text {name} is not UTF-8 text (byte {e.start:,})") from None
    if not text.strip():
        raise UsageError(f"--text {name} is empty")
    return text


@dataclass(frozen=True)
class Tokens:
    """The text's ids, the UTF-8 bytes each token adds, and the BOS put first in every window
    (None: the tokenizer adds none)."""

    ids: list[int]
    n_bytes: list[int]
    bos: int | None


def tokenise(text: str, tokenizer: Any, r: Rule, name: str) -> Tokens:
    """The text tokenised once (special tokens as the tokenizer adds them), cut to --max-tokens;
    shorter than one window is refused. Its first lines are checked against a GGUF model's own
    reading first (`_check_lines`)."""
    _check_lines(text, tokenizer)
    bos = _bos(tokenizer)
    try:
        enc = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True, verbose=False)
        ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    except (NotImplementedError, ValueError, TypeError, KeyError):
        ids, offsets = list(tokenizer(text, add_special_tokens=True)["input_ids"]), None
    if r.max_tokens is not None:
        ids = ids[: r.max_tokens]
    if len(ids) < r.ctx:
        raise UsageError(
            f"--text {name} has {len(ids):,} tokens, fewer than one window (--ctx {r.ctx})",
            hint="give a longer text or a smaller --ctx",
        )
    return Tokens(ids, _bytes(text, ids, offsets, tokenizer), bos)


CHECKED_CHARS = 2000
"""A longer line is checked on its first characters, cut at a space."""


def _check_lines(text: str, tokenizer: Any) -> None:
    """The first lines' ids from `tokenizer`, each read alone, checked against the files being
    watched (a GGUF model's own reading of them, as tune checks its first texts; nothing outside
    `file_tokens.watching`)."""
    from embedlens.model import file_tokens

    lines = [line for line in text.splitlines() if line.strip()][: file_tokens.CHECKED_TEXTS]
    for line in lines:
        if len(line) > CHECKED_CHARS:
            cut = line.rfind(" ", 0, CHECKED_CHARS)
            line = line[: cut if cut > 0 else CHECKED_CHARS]
        ids = [int(i) for i in tokenizer(line, add_special_tokens=True)["input_ids"]]
        file_tokens.check_ids(line, True, ids)


def _bos(tokenizer: Any) -> int | None:
    """The BOS id when the tokenizer puts one first (llama-perplexity puts it first in every
    window then)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    with_special = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    return int(bos) if with_special[:1] == [bos] else None


def _bytes(text: str, ids: list[int], offsets: list[Any] | None, tokenizer: Any) -> list[int]:
    """The UTF-8 bytes each token adds: from the tokenizer's character offsets (a token's end
    minus the previous token's end), else each token's decoded text."""
    if offsets is None:
        return [len(tokenizer.decode([i]).encode("utf-8")) for i in ids]
    import numpy as np

    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    width = 1 + (points >= 0x80).astype(np.int64) + (points >= 0x800) + (points >= 0x10000)
    at = np.concatenate([[0], np.cumsum(width)])
    out, seen = [], 0
    for _, end in offsets[: len(ids)]:
        e = int(at[min(int(end), len(points))])
        out.append(max(e - seen, 0))
        seen = max(seen, e)
    return out
