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

from embedlens.compat.jinja import sandbox_checks
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
        _output_bound(limit, too_long) if checked else nullcontext(),
        _bounded_sandbox(limit, what) if checked else nullcontext(),
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
    """Make Jinja stop joining a template's output once it passes `limit` characters (a
    render under way elsewhere, outside `render`, joins as Jinja does)."""
    import jinja2

    def join(pieces: Iterable[str]) -> str:
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

    before = jinja2.Environment.__dict__["concat"]
    jinja2.Environment.concat = staticmethod(join)
    try:
        yield
    finally:
        jinja2.Environment.concat = before


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


@contextmanager
def _bounded_sandbox(limit: int, what: str) -> Iterator[None]:
    """Make Jinja's sandbox refuse an operation whose result would pass `limit` characters
    before it runs: `'x' * 10**10`, `'x'.ljust(10**10)` or `'%*s' % (10**10, '')` run in one C
    call, where no timer interrupts them. Checked: the operators `*`, `**`, `+` and `%`, calls
    of str methods that grow a string, str.format, the filters that can (center, indent,
    format, tojson, join, ...), `~`, and each value a template writes out. Templates compiled
    while this is open carry the checks (transformers compiles a template in its sandbox on
    first use, and keeps it); Jinja folds no intercepted operator at compile time."""
    import jinja2.runtime
    from jinja2.sandbox import SandboxedEnvironment as Sandbox

    hooks = _Hooks(Sandbox, jinja2.runtime)
    token = _BOUND.set((limit, what))
    try:
        with (
            _patched(Sandbox, "intercepted_binops", Sandbox.intercepted_binops | _BINOPS),
            _patched(Sandbox, "call_binop", _method(hooks.call_binop)),
            _patched(Sandbox, "call", _method(hooks.call)),
            _patched(Sandbox, "wrap_str_format", _method(hooks.wrap_str_format)),
            _patched(Sandbox, "from_string", _method(hooks.from_string)),
        ):
            yield
    finally:
        _BOUND.reset(token)


_BINOPS = frozenset({"*", "**", "+", "%"})


def _method(hook: Callable[..., Any]) -> Callable[..., Any]:
    """A hook as a method of the sandbox's class (the environment passed as its first argument)."""

    def method(env: Any, /, *args: Any, **kwargs: Any) -> Any:
        return hook(env, *args, **kwargs)

    return method


@contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    """Set an attribute of a class or module for the block, then put back what was there."""
    own = vars(owner)
    had, before = name in own, own.get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, before)
        else:
            delattr(owner, name)


class _Hooks:
    """What stands in for the sandbox's own methods while a template renders."""

    def __init__(self, sandbox: type, runtime: Any) -> None:
        names = ("call_binop", "call", "wrap_str_format", "from_string")
        self.sandbox = {name: getattr(sandbox, name) for name in names}
        self.str_join, self.markup_join = runtime.str_join, runtime.markup_join

    def call_binop(self, env: Any, context: Any, operator: str, left: Any, right: Any) -> Any:
        """An intercepted operator, checked first."""
        _check(lambda: _binop_size(operator, left, right), f"'{operator}'")
        return self.sandbox["call_binop"](env, context, operator, left, right)

    def call(self, env: Any, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        """A call from the template (str methods checked first)."""
        name = f"{getattr(obj, '__name__', 'a call')}()"
        _check(lambda: method_size(obj, args, kwargs), name)
        return self.sandbox["call"](env, context, obj, *args, **kwargs)

    def wrap_str_format(self, env: Any, value: Any) -> Any:
        """The sandbox's str.format, checked first."""
        wrapper = self.sandbox["wrap_str_format"](env, value)
        if wrapper is None:
            return None
        fmt, by_map = value.__self__, value.__name__ == "format_map"

        def checked(*args: Any, **kwargs: Any) -> Any:
            named = args[0] if by_map and args and isinstance(args[0], Mapping) else kwargs
            given = () if by_map else args
            _check(lambda: format_size(fmt, given, named), "str.format()")
            return wrapper(*args, **kwargs)

        return checked

    def from_string(self, env: Any, source: Any, *args: Any, **kwargs: Any) -> Any:
        """Compile a template whose filters, `~` and output are checked."""
        import jinja2.runtime

        for name in FILTERS_CHECKED:
            found = env.filters.get(name)
            if found is not None and not hasattr(found, "_embedlens_checked"):
                env.filters[name] = _checked_filter(name, found)
        if env.finalize is None:
            env.finalize = _checked_output
        str_join, markup_join = _checked_join(self.str_join), _checked_join(self.markup_join)
        # the compiled module imports both from jinja2.runtime when it is run
        with (
            _patched(jinja2.runtime, "str_join", str_join),
            _patched(jinja2.runtime, "markup_join", markup_join),
        ):
            return self.sandbox["from_string"](env, source, *args, **kwargs)


def _binop_size(operator: str, left: Any, right: Any) -> int | None:
    if operator == "+":
        return concat_size(left, right)
    if operator == "%":
        return printf_size(left, right) if isinstance(left, str | bytes) else None
    return repeat_size(operator, left, right)


def _checked_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """A filter that checks the size of what it would build first (Jinja's pass_* marks kept)."""
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
