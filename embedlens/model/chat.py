"""Render a model's chat template within bounds of time and size.

A chat template is code shipped with the model: one that loops for ever or writes millions of
characters must end in a clear error, not a hang or gigabytes of text to tokenise.
"""

from __future__ import annotations

import math
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from embedlens.errors import ConfigError, UsageError

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
    with (
        _output_bound(limit, too_long),
        _bounded_operators(limit, what),
        _time_bound(SECONDS, what),
    ):
        try:
            text = str(render_fn())
        except OverflowError as e:  # the sandbox's bound on range(), or a float too large
            raise ConfigError(
                f"{what} fails: {e}", hint="the template is broken; fix it, or run without --chat"
            ) from e
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
def _bounded_operators(limit: int, what: str) -> Iterator[None]:
    """Make Jinja's sandbox refuse a `*` or `**` whose result would pass `limit` characters
    (or digits) before computing it: `'x' * 10**10` runs in C, where no timer interrupts it.
    Templates compiled while this is open call the check (transformers compiles a template in
    its sandbox on first use); Jinja folds no intercepted operator at compile time."""
    from jinja2.sandbox import SandboxedEnvironment

    def call_binop(env: Any, context: Any, operator: str, left: Any, right: Any) -> Any:
        size = _result_size(operator, left, right)
        if size is not None and size > limit:
            raise ConfigError(
                f"{what} computes a value of about {size:,} characters with '{operator}', more "
                f"than the {limit:,} the model's context can hold",
                hint="the template is broken; fix it, or run without --chat",
            )
        return before_call(env, context, operator, left, right)

    before_ops = SandboxedEnvironment.__dict__["intercepted_binops"]
    before_call = SandboxedEnvironment.__dict__["call_binop"]
    SandboxedEnvironment.intercepted_binops = before_ops | {"*", "**"}
    SandboxedEnvironment.call_binop = call_binop  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        SandboxedEnvironment.intercepted_binops = before_ops
        SandboxedEnvironment.call_binop = before_call  # type: ignore[method-assign]


def _result_size(operator: str, left: Any, right: Any) -> int | None:
    """The length of a repeated sequence, or the decimal digits of a power of integers; None
    for anything else."""
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, str | list | tuple) and isinstance(n, int):
                return len(seq) * max(n, 0)
        return None
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        return int(right * math.log10(abs(left))) + 1 if abs(left) > 1 else 1
    return None


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


MAX_TEMPLATE_BYTES = 1 << 20
"""The largest chat template file read (real ones are a few KiB)."""


def read_template(path: str | os.PathLike[str]) -> str:
    """A chat template from a file (UTF-8 Jinja text); a file that cannot be one is a
    UsageError naming it."""
    where = os.fspath(path)
    try:
        with open(where, "rb") as fh:
            raw = fh.read(MAX_TEMPLATE_BYTES + 1)
    except IsADirectoryError:
        raise UsageError(f"--chat-template '{where}' is a folder, not a template file") from None
    except OSError as e:
        raise UsageError(f"cannot read --chat-template '{where}': {e.strerror or e}") from None
    if len(raw) > MAX_TEMPLATE_BYTES:
        raise UsageError(
            f"--chat-template '{where}' is larger than {MAX_TEMPLATE_BYTES >> 20} MiB: not a chat "
            "template"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"--chat-template '{where}' is not UTF-8 text") from None
    if not text.strip():
        raise UsageError(f"--chat-template '{where}' is empty")
    return text
