"""Jinja: whether embedlens' size checks may go inside its sandbox (`embedlens.model.chat`).

transformers makes the sandbox that renders a model's chat template (and keeps what it compiled),
so the checks cannot live in a sandbox of embedlens' own: they stand in for some of Jinja's
methods and joins while a template renders, and act only inside that render (a ContextVar).
Some of what they stand in for is Jinja's own (`wrap_str_format`, `Environment.concat`,
`runtime.str_join`), so they are used only on the releases and signatures they were written
against; elsewhere, and with EMBEDLENS_PLAIN=1, a template renders as transformers renders it,
bounded in time and checked for size once rendered.
"""

from __future__ import annotations

import functools
import inspect
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
