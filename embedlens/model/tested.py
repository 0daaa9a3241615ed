"""The releases of other libraries embedlens is tested with, and the ones installed."""

from __future__ import annotations

import re

TESTED_TRANSFORMERS = "5.24.0"
"""The newest transformers release the suite is run on (pyproject admits older ones)."""


def installed_transformers() -> str | None:
    """The installed transformers release, from its package metadata (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return None


def release_key(text: str) -> tuple[int, ...]:
    """A release's leading numbers ('5.24.0' -> (5, 24, 0); '5.25.0.dev0' -> (5, 25, 0)), for
    comparing releases: at least three ('5.24' is '5.24.0')."""
    found = re.match(r"\d+(?:\.\d+)*", text.strip())
    numbers = tuple(int(part) for part in found.group(0).split(".")) if found else ()
    return numbers + (0,) * (3 - len(numbers))
