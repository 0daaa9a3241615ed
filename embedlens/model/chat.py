"""Render a model's chat template within bounds of time and size.

A chat template is code shipped with the model: one that loops for ever or writes millions of
characters must end in a clear error, not a hang or gigabytes of text to tokenise.
"""

from __future__ import annotations

import functools
import inspect
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from embedlens.compat.jinja2 import Checks, hooked_sandbox, sandbox_checks
from embedlens.errors import ConfigError, UsageError
from embedlens.model.chat_sizes import (
    FILTERS_CHECKED,
    concat_size,
    filter_size,
    format_size,
    method_size,
    printf_size,
    repeat_size,
    value_size,
)

if TYPE_CHECKING:
    from embedlens.io.source import ModelSource

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
    checked = sandbox_checks()  # else transformers' render alone, bounded in time and size
    with (
        hooked_sandbox(_checks(limit, too_long)) if checked else nullcontext(),
        _bounded(limit, what) if checked else nullcontext(),
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


_BOUND: ContextVar[tuple[int, str] | None] = ContextVar("embedlens_chat_bound", default=None)
"""(limit, what) while a template renders; None otherwise (the bounded filters and joins a
compiled template keeps then run as Jinja's own)."""


def _check(estimate: Callable[[], int | None], how: str) -> None:
    """ConfigError when the operation about to run would build a value past the bound of the
    template rendering now; `estimate()` gives its size, or None when it cannot tell."""
    bound = _BOUND.get()
    if bound is None:
        return
    limit, what = bound
    size = estimate()
    if size is not None and size > limit:
        raise ConfigError(
            f"{what} computes a value of about {size:,} characters with {how}, more than the "
            f"{limit:,} the model's context can hold",
            hint="the template is broken; fix it, or run without --chat",
        )


def _checks(limit: int, error: ConfigError) -> Checks:
    """What a render bounded by `limit` characters checks (inside Jinja: `hooked_sandbox`):
    `'x' * 10**10`, `'x'.ljust(10**10)` or `'%*s' % (10**10, '')` run in one C call, where no
    timer interrupts them, so each is refused before it runs. Checked: the operators `*`, `**`,
    `+` and `%`, calls of str methods that grow a string, str.format, the filters that can
    (center, indent, format, tojson, join, ...), `~`, each value a template writes out, and the
    join of the output. A compiled template keeps its checks; outside `render` they pass."""

    def concat(pieces: Iterable[str]) -> str:
        if _BOUND.get() is None:
            return "".join(pieces)
        kept: list[str] = []
        size = 0
        for piece in pieces:
            size += len(piece)
            if size > limit:
                raise error
            kept.append(piece)
        return "".join(kept)

    def call(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        name = f"{getattr(obj, '__name__', 'a call')}()"
        _check(lambda: method_size(obj, args, kwargs), name)

    def str_format(fmt: Any, args: tuple[Any, ...], named: Mapping[str, Any]) -> None:
        _check(lambda: format_size(fmt, args, named), "str.format()")

    return Checks(
        binop=lambda op, left, right: _check(lambda: _binop_size(op, left, right), f"'{op}'"),
        call=call,
        str_format=str_format,
        filters=frozenset(FILTERS_CHECKED),
        filter=_checked_filter,
        join=_checked_join,
        output=_checked_output,
        concat=concat,
    )


@contextmanager
def _bounded(limit: int, what: str) -> Iterator[None]:
    """The bound the checks read while a template renders."""
    token = _BOUND.set((limit, what))
    try:
        yield
    finally:
        _BOUND.reset(token)


def _binop_size(operator: str, left: Any, right: Any) -> int | None:
    if operator == "+":
        return concat_size(left, right)
    if operator == "%":
        return printf_size(left, right) if isinstance(left, str | bytes) else None
    return repeat_size(operator, left, right)


def _checked_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """A filter that checks the size of what it would build first (Jinja's pass_* marks kept);
    one already checked as it is."""
    if hasattr(fn, "_embedlens_checked"):
        return fn
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn

    def estimate(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return None  # the filter raises its own error
        bound.apply_defaults()
        return filter_size(name, bound.arguments)

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        _check(lambda: estimate(args, kwargs), f"the {name} filter")
        return fn(*args, **kwargs)

    checked._embedlens_checked = True  # type: ignore[attr-defined]
    return checked


def _checked_join(join: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Jinja's `~` (str_join, markup_join), checking the size of what it joins first."""

    def checked(seq: Any) -> Any:
        items = list(seq)
        _check(lambda: sum(value_size(item) for item in items), "'~'")
        return join(items)

    return checked


def _checked_output(value: Any) -> Any:
    """The template's finalize: a value it writes out is checked before str() writes it (a
    list holding itself many times over can write out terabytes)."""
    if not isinstance(value, str):
        _check(lambda: value_size(value), "'{{ ... }}'")
    return value


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


def stored_template(source: ModelSource) -> bool | None:
    """Whether the model's files hold a chat template, told from what is on disk (a GGUF header's
    `tokenizer.chat_template`; `chat_template.jinja` or `.json`, or a `chat_template` in
    tokenizer_config.json), before any tokenizer is built; None when it cannot be told without a
    download."""
    import json

    if source.is_gguf:
        from embedlens.io.gguf import read_gguf_header

        assert source.path is not None
        return bool(read_gguf_header(source.path).metadata.get("tokenizer.chat_template"))
    if any(
        source.cached(name) is not None for name in ("chat_template.jinja", "chat_template.json")
    ):
        return True
    config = source.cached("tokenizer_config.json")
    if config is None:
        return None if source.kind == "hub" else False
    try:
        return bool(json.loads(config.read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return None  # the tokenizer's own loading says what is wrong with the file
