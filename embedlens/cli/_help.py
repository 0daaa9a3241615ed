"""--help's text, wrapped at spaces only: an option name (`--chat-template`) or a long word is
never broken at a hyphen or cut at the width.

Click's help formatter wraps with a `textwrap.TextWrapper` that breaks at hyphens. While the help
is made, its module's wrapper is one that does not, and the module is given its own back after
(nothing else in the process sees the change)."""

from __future__ import annotations

import importlib
import sys
from typing import Any


def help_text(ctx: Any) -> str:
    """`ctx.get_help()`, its lines broken at spaces only."""
    formatting = sys.modules[type(ctx.make_formatter()).__module__]
    wrapping = importlib.import_module(f"{formatting.__package__}._textwrap")
    theirs = wrapping.TextWrapper

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
