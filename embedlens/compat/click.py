"""click (as typer vendors it, or the package): its private part embedlens uses, on the typer
releases it was checked on, with the public path elsewhere and under EMBEDLENS_PLAIN=1.

- `help_at_spaces`: a command's help made while click's formatting module wraps with a
  `TextWrapper` that breaks lines at spaces only (its `_textwrap` module's class, swapped for the
  call and put back after), so an option name (`--chat-template`) is never broken at a hyphen;
  else `ctx.get_help()` as click makes it.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from typing import Any

from embedlens.compat import checked_release

TYPER_CHECKED = ((0, 26), (0, 29))
"""The typer releases this was checked on (pyproject admits 0.26 to 0.28)."""


def help_at_spaces(ctx: Any) -> str:
    """`ctx.get_help()`, its lines broken at spaces only where that may be done."""
    formatting = sys.modules[type(ctx.make_formatter()).__module__]
    wrapping = None
    if checked_release("typer", *TYPER_CHECKED):
        wrapping = importlib.import_module(f"{formatting.__package__}._textwrap")
    theirs = getattr(wrapping, "TextWrapper", None)
    if not (isinstance(theirs, type) and issubclass(theirs, textwrap.TextWrapper)):
        return str(ctx.get_help())

    class _AtSpaces(theirs):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("break_on_hyphens", False)
            kwargs.setdefault("break_long_words", False)
            super().__init__(*args, **kwargs)

    setattr(wrapping, "TextWrapper", _AtSpaces)  # noqa: B010
    try:
        return str(ctx.get_help())
    finally:
        setattr(wrapping, "TextWrapper", theirs)  # noqa: B010
