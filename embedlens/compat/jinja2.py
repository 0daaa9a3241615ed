"""Jinja: embedlens' size checks inside its sandbox (what they check: `embedlens.model.chat`),
and whether they may go there (`sandbox_checks`).

transformers makes the sandbox that renders a model's chat template (and keeps what it compiled),
so the checks cannot live in a sandbox of embedlens' own: `hooked_sandbox` stands them in for
some of Jinja's methods and joins while a template renders (they act only inside that render).
Some of what they stand in for is Jinja's own (`wrap_str_format`, `Environment.concat`,
`runtime.str_join`), so they are used only on the releases and signatures they were written
against; elsewhere, and with EMBEDLENS_PLAIN=1, a template renders as transformers renders it,
bounded in time and checked for size once rendered.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from embedlens.compat import plain, public_path, within

JINJA_CHECKED = ((3, 1), (3, 2))
"""The Jinja releases the checks were written against: 3.1.x."""

_SHAPES = {
    "SandboxedEnvironment.call_binop": ("self", "context", "operator", "left", "right"),
    "SandboxedEnvironment.call": (
        "_SandboxedEnvironment__self",
        "_SandboxedEnvironment__context",
        "_SandboxedEnvironment__obj",
        "*args",
        "**kwargs",
    ),
    "SandboxedEnvironment.wrap_str_format": ("self", "value"),
    "Environment.from_string": ("self", "source", "globals", "template_class"),
    "runtime.str_join": ("seq",),
    "runtime.markup_join": ("seq",),
}
"""The parameters of what the checks stand in for, as Jinja 3.1 has them."""


def sandbox_checks() -> bool:
    """Whether a template renders with embedlens' checks inside Jinja (`embedlens.model.chat`
    hooks them into Jinja's sandbox for the render, `_bounded_sandbox`): not with
    EMBEDLENS_PLAIN set, nor (with one note) on a Jinja release or signature they were not
    written against; then it renders as transformers renders it, with its time bound and the
    size of its text checked after."""
    if plain():
        return False
    fits = _jinja_fits()
    if fits is not None:
        public_path(f"the chat template renders without embedlens' checks inside Jinja: {fits}")
    return fits is None


@functools.cache
def _jinja_fits() -> str | None:
    """None when Jinja is what the checks were written against, else what differs."""
    import jinja2
    import jinja2.runtime
    from jinja2.sandbox import SandboxedEnvironment

    if not within("jinja2", *JINJA_CHECKED):
        return f"jinja2 {jinja2.__version__} is not a 3.1 release"
    owners: dict[str, Any] = {
        "SandboxedEnvironment": SandboxedEnvironment,
        "Environment": jinja2.Environment,
        "runtime": jinja2.runtime,
    }
    for name, shape in _SHAPES.items():
        owner, _, attr = name.partition(".")
        if _shape(getattr(owners[owner], attr, None)) != shape:
            return f"jinja2's {name} is not as in 3.1"
    if jinja2.Environment.__dict__.get("concat") != "".join:
        return "jinja2's Environment.concat is not as in 3.1"
    if not isinstance(getattr(SandboxedEnvironment, "intercepted_binops", None), frozenset):
        return "jinja2's SandboxedEnvironment.intercepted_binops is not as in 3.1"
    return None


def _shape(fn: Any) -> tuple[str, ...] | None:
    """A callable's parameter names ('*args', '**kwargs' marked); None when it has none."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    star: dict[Any, str] = {
        inspect.Parameter.VAR_POSITIONAL: "*",
        inspect.Parameter.VAR_KEYWORD: "**",
    }
    return tuple(star.get(p.kind, "") + p.name for p in params)


@dataclass(frozen=True)
class Checks:
    """What a bounded render checks (each raises before an operation whose result would be too
    large): the intercepted operators, calls, str.format, the filters named in `filters`, `~`,
    each value written out, and the join of the whole output."""

    binop: Callable[[str, Any, Any], None]
    """(operator, left, right) before `*`, `**`, `+` or `%` runs."""
    call: Callable[[Any, tuple[Any, ...], dict[str, Any]], None]
    """(callable, args, kwargs) before a call from the template."""
    str_format: Callable[[Any, tuple[Any, ...], Mapping[str, Any]], None]
    """(format string, positional, named) before str.format or format_map."""
    filters: frozenset[str]
    filter: Callable[[str, Callable[..., Any]], Callable[..., Any]]
    """A filter of `filters` wrapped so that it checks first."""
    join: Callable[[Callable[[Any], Any]], Callable[[Any], Any]]
    """Jinja's `~` joins wrapped so that they check first."""
    output: Callable[[Any], Any]
    """The environment's finalize (where it has none): each value written out."""
    concat: Callable[[Iterable[str]], str]
    """What joins the template's output (Jinja's `Environment.concat`)."""


@contextmanager
def hooked_sandbox(checks: Checks) -> Iterator[None]:
    """Jinja's sandbox with `checks` inside it for the block: templates compiled while it is open
    carry them (transformers compiles a template in its sandbox on first use, and keeps it);
    Jinja folds no intercepted operator at compile time. Everything is put back after."""
    import jinja2
    import jinja2.runtime
    from jinja2.sandbox import SandboxedEnvironment as Sandbox

    hooks = _Hooks(Sandbox, jinja2.runtime, checks)
    with (
        _patched(jinja2.Environment, "concat", staticmethod(checks.concat)),
        _patched(Sandbox, "intercepted_binops", Sandbox.intercepted_binops | _BINOPS),
        _patched(Sandbox, "call_binop", _method(hooks.call_binop)),
        _patched(Sandbox, "call", _method(hooks.call)),
        _patched(Sandbox, "wrap_str_format", _method(hooks.wrap_str_format)),
        _patched(Sandbox, "from_string", _method(hooks.from_string)),
    ):
        yield


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

    def __init__(self, sandbox: type, runtime: Any, checks: Checks) -> None:
        names = ("call_binop", "call", "wrap_str_format", "from_string")
        self.sandbox = {name: getattr(sandbox, name) for name in names}
        self.str_join, self.markup_join = runtime.str_join, runtime.markup_join
        self.checks = checks

    def call_binop(self, env: Any, context: Any, operator: str, left: Any, right: Any) -> Any:
        """An intercepted operator, checked first."""
        self.checks.binop(operator, left, right)
        return self.sandbox["call_binop"](env, context, operator, left, right)

    def call(self, env: Any, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        """A call from the template, checked first."""
        self.checks.call(obj, args, kwargs)
        return self.sandbox["call"](env, context, obj, *args, **kwargs)

    def wrap_str_format(self, env: Any, value: Any) -> Any:
        """The sandbox's str.format, checked first."""
        wrapper = self.sandbox["wrap_str_format"](env, value)
        if wrapper is None:
            return None
        fmt, by_map = value.__self__, value.__name__ == "format_map"

        def checked(*args: Any, **kwargs: Any) -> Any:
            named = args[0] if by_map and args and isinstance(args[0], Mapping) else kwargs
            self.checks.str_format(fmt, () if by_map else args, named)
            return wrapper(*args, **kwargs)

        return checked

    def from_string(self, env: Any, source: Any, *args: Any, **kwargs: Any) -> Any:
        """Compile a template whose filters, `~` and output are checked."""
        import jinja2.runtime

        for name in self.checks.filters:
            found = env.filters.get(name)
            if found is not None:
                env.filters[name] = self.checks.filter(name, found)
        if env.finalize is None:
            env.finalize = self.checks.output
        str_join = self.checks.join(self.str_join)
        markup_join = self.checks.join(self.markup_join)
        # the compiled module imports both from jinja2.runtime when it is run
        with (
            _patched(jinja2.runtime, "str_join", str_join),
            _patched(jinja2.runtime, "markup_join", markup_join),
        ):
            return self.sandbox["from_string"](env, source, *args, **kwargs)
