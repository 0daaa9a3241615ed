"""A command's report told of the files it read from the hub by byte range
(`counts_hub_reads`): the reads are counted in io (`ranges.tally`), the report is the command's."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from embedlens.io.ranges import tally

R = TypeVar("R")
P = ParamSpec("P")


def counts_hub_reads(fn: Callable[P, R]) -> Callable[P, R]:
    """Run a command's function counting its ranged reads: the report it returns (a dataclass
    with `notes` and `hub_fetched_bytes`) gets a note per file read by range and the bytes
    fetched."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with tally() as hub:
            report = fn(*args, **kwargs)
        if not hub.used:
            return report
        notes = [*getattr(report, "notes", []), *hub.notes()]
        changed: R = dataclasses.replace(  # type: ignore[type-var]
            report, notes=notes, hub_fetched_bytes=hub.fetched
        )
        return changed

    return wrapper
