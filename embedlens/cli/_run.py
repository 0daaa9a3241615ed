"""The end every command shares: its common options applied, the work under a spinner on stderr,
the report's notes on stderr, then the report on stdout."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TypeVar

from embedlens.cli._options import common
from embedlens.cli._output import emit, note, progress
from embedlens.reports import Report
from embedlens.runtime import world

R = TypeVar("R", bound=Report)


def say_notes(report: Report) -> None:
    """The report's notes on stderr, one `note:` line each (silenced by --quiet)."""
    for text in report.notes:
        note("note: " + text)


def run_report(
    model: str,
    work: Callable[[], R],
    *,
    as_json: bool,
    quiet: bool,
    debug: bool,
    device: str | None = None,
    doing: str = "Reading",
    spinner: bool = True,
    check: Callable[[], None] | None = None,
    say: Callable[[R], None] = say_notes,
    split: bool = False,
) -> R:
    """Run a command's work and print its report, as every command does.

    --quiet, --debug and --device are applied and checked first (`common`), then `check` (a
    command's own checks before any work), then the work under a spinner ("{doing} {model}",
    none when `spinner` is off); `say` writes what the report has for stderr (its notes), and
    the report goes to stdout (one JSON object with --json, else its tables). Returns the report.
    `split`: the work splits over torchrun's processes, and rank 0 alone prints.
    """
    common(quiet=quiet, debug=debug, device=device, split=split)
    if check is not None:
        check()
    shown: AbstractContextManager[None] = progress(f"{doing} {model}") if spinner else nullcontext()
    with shown:
        report = work()
    if split and world()[0] != 0:
        return report
    say(report)
    emit(report, as_json=as_json)
    return report
