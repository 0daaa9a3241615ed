"""Prompts for `lens --prompts`: a file (or stdin) of one prompt per line or of JSON Lines, or
prompts given in Python.

A file is JSON Lines when its first non-blank line starts with `{`: each line is then an object
with `prompt` and optional `target`, `chat` (a user message) and `id`. Otherwise each line is one
prompt, as written (its line break removed). Empty lines are skipped in both forms. A source can
be read more than once (it is checked whole before the model loads, then run), one line at a
time: stdin is spooled to a temporary file past a few megabytes, so memory stays bounded.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any

from embedlens.errors import SourceError, UsageError

FIELDS = ("prompt", "target", "chat", "id")
_SPOOL_BYTES = 8 * 2**20


@dataclass(frozen=True)
class PromptLine:
    """One prompt as given: its line number (1-based; the index + 1 for a Python list)."""

    line: int
    prompt: str
    target: str | None = None
    chat: str | None = None
    id: str | int | None = None


class BadLine(UsageError):
    """A line that is not a prompt (exit 2), its number in `line`."""

    def __init__(
        self, line: int, message: str, *, hint: str | None = None, where: str | None = None
    ) -> None:
        super().__init__(f"{where + ' ' if where else ''}line {line}: {message}", hint=hint)
        self.line = line
        self.reason = message


class PromptSource:
    """Prompts that can be read more than once: a file, spooled stdin, or a Python list."""

    def __init__(
        self,
        *,
        path: str | None = None,
        spool: IO[bytes] | None = None,
        items: list[str | Mapping[str, Any]] | None = None,
    ) -> None:
        self.path = path
        self.spool = spool
        self.items = items

    @classmethod
    def open(cls, name: str | os.PathLike[str]) -> PromptSource:
        """A file of prompts, or `-` for stdin (read now, into a spooled temporary file)."""
        text = os.fspath(name)
        if text == "-":
            return cls(spool=_spool(sys.stdin.buffer))
        if not os.path.isfile(text):
            what = "a folder" if os.path.isdir(text) else "no such file"
            raise UsageError(f"--prompts '{text}': {what}", hint="name a file of prompts, or -")
        return cls(path=text)

    @classmethod
    def of(cls, prompts: Iterable[str | Mapping[str, Any]] | PromptSource) -> PromptSource:
        """Prompts given in Python: strings, or dicts with the JSON Lines keys."""
        if isinstance(prompts, PromptSource):
            return prompts
        if isinstance(prompts, (str, bytes, Mapping)):
            raise UsageError(
                "prompts= takes a list of prompts (strings or dicts), not one prompt",
                hint="pass [prompt], or the prompt as the second argument",
            )
        return cls(items=list(prompts))

    def __iter__(self) -> Iterator[PromptLine | BadLine]:
        """Every prompt in order, or the reason its line is not one."""
        if self.items is not None:
            for n, item in enumerate(self.items, 1):
                yield _from_item(item, n)
            return
        mode: bool | None = None
        for n, raw in self._lines():
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                where = f"--prompts '{self.path}'" if self.path is not None else "--prompts -"
                yield BadLine(n, "not UTF-8 text", where=where)
                continue
            text = text.rstrip("\r\n")
            if not text.strip() and (mode is not False or not text):
                continue
            if mode is None:
                mode = text.lstrip().startswith("{")
            yield _from_json(text, n) if mode else PromptLine(n, text)

    def _lines(self) -> Iterator[tuple[int, bytes]]:
        if self.spool is not None:
            self.spool.seek(0)
            yield from enumerate(self.spool, 1)
            return
        assert self.path is not None
        try:
            with open(self.path, "rb") as fh:
                yield from enumerate(fh, 1)
        except OSError as e:
            raise SourceError(f"cannot read --prompts '{self.path}': {e.strerror or e}") from None


def _spool(stream: IO[bytes]) -> IO[bytes]:
    """stdin copied once, in memory up to a few megabytes and on disk (deleted) past that."""
    spool: IO[bytes] = tempfile.SpooledTemporaryFile(max_size=_SPOOL_BYTES)  # noqa: SIM115
    while chunk := stream.read(1 << 20):
        spool.write(chunk)
    return spool


def _from_json(text: str, n: int) -> PromptLine | BadLine:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return BadLine(n, f"invalid JSON ({e.msg} at column {e.colno})")
    if not isinstance(value, dict):
        return BadLine(n, f"a JSON object is needed, not {type(value).__name__}")
    return _from_item(value, n)


def _from_item(item: object, n: int) -> PromptLine | BadLine:
    """A prompt string, or a dict with `prompt` and optional `target`, `chat` and `id`."""
    if isinstance(item, str):
        return PromptLine(n, item)
    if not isinstance(item, Mapping):
        return BadLine(n, f"a prompt is a string or a dict, not {type(item).__name__}")
    unknown = [str(k) for k in item if k not in FIELDS]
    if unknown:
        return BadLine(n, f"unknown key '{unknown[0]}'", hint="the keys are " + ", ".join(FIELDS))
    prompt = item.get("prompt")
    if not isinstance(prompt, str):
        return BadLine(n, "'prompt' must be given, as a string")
    for key in ("target", "chat"):
        if item.get(key) is not None and not isinstance(item[key], str):
            return BadLine(n, f"'{key}' must be a string")
    ident = item.get("id")
    if ident is not None and (isinstance(ident, bool) or not isinstance(ident, (str, int))):
        return BadLine(n, "'id' must be a string or an integer")
    return PromptLine(n, prompt, item.get("target"), item.get("chat"), ident)
