"""Where embedlens leans on another library's private parts, one module per library.

Each shortcut here is taken only where what it relies on is checked (the library's release and
the signatures of the functions it calls); anywhere else embedlens takes the library's public
path, with one `note:` saying so. `EMBEDLENS_PLAIN=1` takes the public path everywhere, without a
note (the figures are the same either way: the suite compares the bytes).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from importlib import metadata

PLAIN_ENV = "EMBEDLENS_PLAIN"


_said: set[str] = set()
_reporter: list[Callable[[str], None]] = []


def plain() -> bool:
    """Whether EMBEDLENS_PLAIN asks for the public path everywhere (set and not 0)."""
    return os.environ.get(PLAIN_ENV, "").strip() not in ("", "0")


def report_to(reporter: Callable[[str], None] | None) -> None:
    """Where notes go: the CLI's `note:` lines (silenced by --quiet); None: a `note:` line
    printed on stderr."""
    _reporter.clear()
    if reporter is not None:
        _reporter.append(reporter)


def say_once(text: str) -> None:
    """A note about the path taken, once per process."""
    if text in _said:
        return
    _said.add(text)
    if _reporter:
        _reporter[0](text)
    else:
        print("note: " + text, file=sys.stderr)


def forget_said() -> None:
    """Say each note again (tests that look for one)."""
    _said.clear()


def release(package: str) -> tuple[int, ...] | None:
    """An installed package's release as numbers (5.24.0 -> (5, 24, 0)); None if unknown."""
    try:
        text = metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
    found = re.match(r"\d+(\.\d+)*", text)
    return tuple(int(part) for part in found.group(0).split(".")) if found else None


def release_text(package: str) -> str:
    """An installed package's release as it names itself ('not installed' if it is not)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def within(distribution: str, low: tuple[int, ...], high: tuple[int, ...]) -> bool:
    """The installed release is at least `low` and below `high`."""
    got = release(distribution)
    return got is not None and low <= got < high


def checked_release(distribution: str, low: tuple[int, ...], high: tuple[int, ...]) -> bool | None:
    """Whether a shortcut over `distribution` may be taken as far as its installed release tells
    (`within` low and high); None under EMBEDLENS_PLAIN, which takes the public path everywhere
    without a note."""
    return None if plain() else within(distribution, low, high)


def public_path(message: str) -> None:
    """One `note:` line, once a process: a shortcut took its public path (`message` says which
    and why). On the command line a note on stderr (silenced by --quiet); from Python a
    `PublicPathNote` warning."""
    say_once(message)
