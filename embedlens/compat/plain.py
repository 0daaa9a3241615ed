"""EMBEDLENS_PLAIN, a library's release as a number, and the note a shortcut gives when it
takes its public path on a release (or signature) it was not checked against."""

from __future__ import annotations

import os
import re
import sys
import threading

_said: set[str] = set()
_lock = threading.Lock()


def plain() -> bool:
    """EMBEDLENS_PLAIN set (and not 0): every shortcut takes its public path."""
    return os.environ.get("EMBEDLENS_PLAIN", "").strip() not in ("", "0")


def release(distribution: str) -> tuple[int, ...] | None:
    """The installed release of a distribution as numbers ('2.13.0+cpu' -> (2, 13, 0)), read
    from its metadata without importing it; None when it is not installed or not numbered."""
    from importlib import metadata

    try:
        text = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None
    found = re.match(r"\d+(?:\.\d+)*", text)
    return None if found is None else tuple(int(p) for p in found.group().split("."))


def within(distribution: str, low: tuple[int, ...], high: tuple[int, ...]) -> bool:
    """The installed release is at least `low` and below `high`."""
    got = release(distribution)
    return got is not None and low <= got < high


def public_path(message: str) -> None:
    """One `note:` line on stderr, once a process: a shortcut took its public path (`message`
    says which and why). Silenced by --quiet on the command line."""
    with _lock:
        if message in _said:
            return
        _said.add(message)
    output = sys.modules.get("embedlens.cli._output")
    if output is not None:
        output.note("note: " + message)
    else:
        print("note: " + message, file=sys.stderr)
