"""Render a model's chat template within bounds of time and size.

A chat template is code shipped with the model: one that loops for ever or writes millions of
characters must end in a clear error, not a hang or gigabytes of text to tokenise.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from embedlens.errors import ConfigError

SECONDS = 5.0
"""How long a chat template may take to render (real ones take milliseconds)."""
CHARS_PER_TOKEN = 64
"""A generous bound on the characters one token of the model's context can hold."""
DEFAULT_CONTEXT = 131072
"""The context assumed when the config gives none."""


def max_chars(context: int | None) -> int:
    """The most characters a rendered chat may hold for a model with this context."""
    tokens = context if isinstance(context, int) and context > 0 else DEFAULT_CONTEXT
    return tokens * CHARS_PER_TOKEN


def render(render_fn: Callable[[], Any], *, limit: int, what: str) -> str:
    """Call render_fn (which renders a chat template) with its time and output size bounded.

    `what` names the template ("the chat template of 'x' (tokenizer_config.json)"); exceeding a
    bound is a ConfigError (exit 1) that says which.
    """
    too_long = ConfigError(
        f"{what} renders more than {limit:,} characters, more than the model's context can hold",
        hint="the template is broken; fix it, or run without --chat",
    )
    with _output_bound(limit, too_long), _time_bound(SECONDS, what):
        text = str(render_fn())
    if len(text) > limit:
        raise too_long
    return text


@contextmanager
def _output_bound(limit: int, error: ConfigError) -> Iterator[None]:
    """Make Jinja stop joining a template's output once it passes `limit` characters."""
    import jinja2

    def join(pieces: Iterable[str]) -> str:
        kept: list[str] = []
        size = 0
        for piece in pieces:
            size += len(piece)
            if size > limit:
                raise error
            kept.append(piece)
        return "".join(kept)

    before = jinja2.Environment.__dict__["concat"]
    jinja2.Environment.concat = staticmethod(join)
    try:
        yield
    finally:
        jinja2.Environment.concat = before


@contextmanager
def _time_bound(seconds: float, what: str) -> Iterator[None]:
    """Raise ConfigError if the block runs longer than `seconds` (main thread on Unix only)."""
    if (
        not hasattr(signal, "setitimer")
        or threading.current_thread() is not threading.main_thread()
    ):
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise ConfigError(
            f"{what} is still rendering after {seconds:g} s: it loops for ever or nearly",
            hint="the template is broken; fix it, or run without --chat",
        )

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
