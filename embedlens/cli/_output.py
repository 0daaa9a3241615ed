"""Output conventions: Rich tables on stdout, one JSON object with --json, notes on stderr."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console, RenderableType
from rich.text import Text

from embedlens.reports import Report, to_json_dict
from embedlens.tokens import visible


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """A closed pipe ends a table as it ends JSON (quietly, exit 0), not with Rich's exit 1."""
        raise BrokenPipeError


# No string printed is read as markup or emoji codes: what is shown is text, never instructions.
console = _Console(highlight=False, soft_wrap=False, markup=False, emoji=False)
err_console = Console(stderr=True, highlight=False, markup=False, emoji=False)

_state = {"quiet": False}


def set_quiet(quiet: bool) -> None:
    """Silence progress and notes on stderr (errors are always shown)."""
    _state["quiet"] = quiet


def write_json(report: Report) -> None:
    """Write the report as exactly one JSON object on stdout, never through Rich."""
    data = to_json_dict(report)
    text = json.dumps(data, ensure_ascii=False, allow_nan=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a MODEL path that is not UTF-8: all escaped, still valid JSON
        text = json.dumps(data, ensure_ascii=True, allow_nan=False)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def emit(report: Report, *, as_json: bool, render: Callable[[Any], RenderableType]) -> None:
    """Print a report: JSON on request, else its Rich rendering."""
    if as_json:
        write_json(report)
    else:
        console.print(render(report))


def note(message: str, *, style: str = "yellow") -> None:
    """A note on stderr (silenced by --quiet)."""
    if not _state["quiet"]:
        err_console.print(shown(message, style=style), soft_wrap=True)


def warn(message: str) -> None:
    """A warning on stderr that --quiet does not silence: something the user must know."""
    err_console.print(shown("warning: " + message, style="bold red"), soft_wrap=True)


@contextmanager
def progress(message: str) -> Iterator[None]:
    """A spinner on stderr while work runs, only on a terminal and without --quiet."""
    if _state["quiet"] or not err_console.is_terminal:
        yield
        return
    with err_console.status(shown(message), spinner="dots"):
        yield


def shown(text: str, style: str = "") -> Text:
    """Text from the user or a model file (a path, a token, a config value) as it is shown.

    A Text is never read as Rich markup (so 'my[red]model' and 'a[/]b' show as written), and
    every control character (C0, DEL, C1, so any escape sequence) is written as an escape.
    """
    return Text(visible(text), style=style)


def quoted(token: str) -> Text:
    """A token in single quotes, shown as `shown` shows text (spaces at its ends visible)."""
    return shown("'" + token + "'")


def count(n: int) -> str:
    """An integer with thousands separators."""
    return f"{n:,}"


def share(x: float) -> str:
    """A fraction as a percentage."""
    return f"{100 * x:.2f}%"


def size(n: int | None) -> str:
    """Bytes in binary units."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{n} B"
