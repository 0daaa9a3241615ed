"""Output conventions: Rich tables on stdout, one JSON object with --json, notes on stderr.

Rich is imported when something is shown through it: the consoles (`console`, `err_console`)
are made when first asked for, so a command that writes JSON and finds stderr plainly no
terminal (`_err_terminal`) never imports it (about 30 ms of a process's start)."""

from __future__ import annotations

import io
import os
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any

from embedlens.errors import OutputError
from embedlens.io import ranges
from embedlens.reports import Report
from embedlens.text import binary_size

if TYPE_CHECKING:
    from rich.console import Console, RenderableType


_SIZE_AT_IMPORT = (os.environ.get("COLUMNS"), os.environ.get("LINES"))
"""COLUMNS and LINES as this module was imported. Rich fixes a console's width and height from
them when the console is made; the consoles were once made at import, and made later they take
the sizes this module was imported with (unset: as they are at each use, as before)."""

_made: dict[tuple[str | None, ...], dict[str, Console]] = {}
"""The consoles, under the sizes they were made for (`_sizes`): the last ones made."""


def _sizes() -> tuple[str | None, ...]:
    """What the consoles' sizes come from now: COLUMNS and LINES as imported, and as they are."""
    return (*_SIZE_AT_IMPORT, os.environ.get("COLUMNS"), os.environ.get("LINES"))


def _consoles() -> dict[str, Console]:
    """The stdout and stderr consoles, made for the sizes that hold now (Rich's public
    `Console(width=, height=)` and its `width` and `height` setters): a size set at import is
    kept; one unset then is the one Rich finds when the console is made, and consoles made
    again when COLUMNS or LINES change. No string printed is read as markup or emoji codes:
    what is shown is text, never instructions."""
    key = _sizes()
    made = _made.get(key)
    if made is None:
        made = _make()
        _made.clear()
        _made[key] = made
    return made


def _make() -> dict[str, Console]:
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            """A closed pipe ends a table as it ends JSON (quietly, exit 0), not with Rich's
            exit 1."""
            raise BrokenPipeError

    made = {
        "console": _Console(highlight=False, soft_wrap=False, markup=False, emoji=False),
        "err_console": Console(stderr=True, highlight=False, markup=False, emoji=False),
    }
    width, height = (int(v) if v is not None and v.isdigit() else None for v in _SIZE_AT_IMPORT)
    for console in made.values():
        if console.is_jupyter:  # Jupyter's sizes come from its own variables
            continue
        if width is not None:
            console.width = width - console.legacy_windows
        if height is not None:
            console.height = height
    return made


def __getattr__(name: str) -> Any:
    """`console` and `err_console`, made when first asked for (one set in their place, as a
    test does, is used instead)."""
    if name not in ("console", "err_console"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _consoles()[name]


def _out() -> Console:
    return globals().get("console") or __getattr__("console")  # type: ignore[no-any-return]


def _err() -> Console:
    return globals().get("err_console") or __getattr__("err_console")  # type: ignore[no-any-return]


def _err_terminal() -> bool:
    """`err_console.is_terminal`, without making the console when stderr is plainly no terminal:
    no tty, TTY_COMPATIBLE not 1 and FORCE_COLOR unset (Rich then finds none either)."""
    if "err_console" not in globals() and not _made and not _may_be_terminal():
        return False
    return bool(_err().is_terminal)


def _may_be_terminal() -> bool:
    if os.environ.get("TTY_COMPATIBLE", "") == "1" or "FORCE_COLOR" in os.environ:
        return True
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty is not None and isatty())
    except ValueError:
        return False


def _shown(text: str, style: str = "") -> Any:
    from embedlens.views.format import shown

    return shown(text, style=style)


_state = {"quiet": False}


def set_quiet(quiet: bool) -> None:
    """Silence progress and notes on stderr (errors are always shown)."""
    _state["quiet"] = quiet


_CLOSED_HINT = "stdout was closed (>&-): send it to a file, a pipe or /dev/null instead"


def check_stdout() -> None:
    """Fail before any work when stdout is closed (`>&-`): nothing could be written."""
    if sys.stdout is None:
        raise OutputError("cannot write the output: stdout is closed", hint=_CLOSED_HINT)


def silence_stdout() -> None:
    """Point stdout at /dev/null, so that what is left in its buffer goes nowhere at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def _file_position() -> int | None:
    """Where stdout stands when it is a regular file (so a failed write can be taken back)."""
    try:
        fd = sys.stdout.fileno()
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return os.lseek(fd, 0, os.SEEK_CUR)
    except (OSError, ValueError, AttributeError):
        pass
    return None


def _write_failed(error: OSError, start: int | None) -> OutputError:
    """Take back a partial write to a file, drop the rest, and say what happened."""
    if start is not None:
        with suppress(OSError, ValueError):
            os.ftruncate(sys.stdout.fileno(), start)
    silence_stdout()
    reason = error.strerror or str(error) or type(error).__name__
    return OutputError(f"cannot write the output to stdout: {reason}")


def _write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is out: a short write is followed up, so a file that stops
    growing ends in an error (EFBIG, ENOSPC) instead of a silent cut."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_stdout(text: str) -> None:
    """Write text to stdout in one write and check it: a failure is an OutputError, and what a
    regular file received of it is taken back (a cut JSON object never looks complete)."""
    check_stdout()
    out = sys.stdout
    try:
        out.flush()
        fd = out.fileno()
    except (AttributeError, ValueError, OSError):  # not a file (a test's capture): write to it
        fd = None
    start = _file_position()
    try:
        if fd is None:
            out.write(text)
            out.flush()
        else:
            _write_all(fd, text.encode(out.encoding or "utf-8", out.errors or "strict"))
    except BrokenPipeError:
        raise
    except OSError as e:
        raise _write_failed(e, start) from None


def write_json(report: Report) -> None:
    """Write the report as exactly one JSON object on stdout, never through Rich."""
    write_stdout(report.to_json() + "\n")


def emit(report: Report, *, as_json: bool) -> None:
    """Print a report: JSON on request, else its Rich rendering."""
    if as_json:
        write_json(report)
        return
    check_stdout()
    write_stdout(rendered(report.__rich__()))


def rendered(renderable: RenderableType) -> str:
    """What the stdout console would print, as a string (so it is written, and checked, once).

    Nothing is cut to the width: a word longer than a line (a fingerprint, a path) stands whole on
    its line, and a table too wide for the terminal keeps its figures and tokens whole and prints
    wider (views.format.Sheet), rather than ending in '…'."""
    from rich.console import Console

    buffer = io.StringIO()
    console = _out()
    Console(
        file=buffer,
        width=console.width,
        color_system=console.color_system,  # type: ignore[arg-type]
        force_terminal=console.is_terminal,
        no_color=console.no_color,
        highlight=False,
        soft_wrap=False,
        markup=False,
        emoji=False,
    ).print(renderable, crop=False)
    return buffer.getvalue()


def note(message: str, *, style: str = "yellow") -> None:
    """A note on stderr (silenced by --quiet)."""
    if not _state["quiet"]:
        _err().print(_shown(message, style=style), soft_wrap=True)


def warn(message: str) -> None:
    """A warning on stderr that --quiet does not silence: something the user must know."""
    _err().print(_shown("warning: " + message, style="bold red"), soft_wrap=True)


PLAIN_EVERY = 10.0
"""Off a terminal (a CI log, nohup, a notebook's `!embedlens`), progress is a plain line on
stderr every this many seconds of a long wait, never an animation; work done sooner prints none.
$EMBEDLENS_PROGRESS_SECONDS sets another interval (0: none)."""


def _plain_every() -> float:
    """PLAIN_EVERY, or $EMBEDLENS_PROGRESS_SECONDS when set to a number (0 or less: no lines)."""
    try:
        return float(os.environ["EMBEDLENS_PROGRESS_SECONDS"])
    except (KeyError, ValueError):
        return PLAIN_EVERY


@contextmanager
def plain_progress(line: Callable[[float], str]) -> Iterator[None]:
    """Off a terminal and without --quiet: every PLAIN_EVERY seconds while the block runs, the
    line `line(seconds elapsed)` on stderr; nothing else (no line for work done sooner)."""
    every = _plain_every()
    if _state["quiet"] or _err_terminal() or every <= 0:
        yield
        return
    stop = threading.Event()
    start = time.monotonic()

    def tick() -> None:
        while not stop.wait(every):
            text = line(time.monotonic() - start)
            with suppress(Exception):  # stderr closed or full: progress is not worth an error
                _err().print(_shown(text), soft_wrap=True, highlight=False)

    thread = threading.Thread(target=tick, name="embedlens-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def elapsed(seconds: float) -> str:
    """Seconds as m:ss."""
    whole = int(seconds)
    return f"{whole // 60}:{whole % 60:02d}"


@contextmanager
def progress(message: str) -> Iterator[None]:
    """A spinner on stderr while work runs on a terminal; off one, a plain line every
    PLAIN_EVERY seconds (neither with --quiet)."""
    if _state["quiet"] or not _err_terminal():
        with plain_progress(lambda t: f"{message}: {elapsed(t)}"):
            yield
        return
    with _err().status(_shown(message), spinner="dots"):
        yield


@contextmanager
def counter(message: str, unit: str) -> Iterator[Callable[[], None]]:
    """A progress line on stderr counting items done and their rate (on a terminal; off one, a
    plain line every PLAIN_EVERY seconds; neither with --quiet); yields the function that counts
    one more. The count comes first, so a long message never hides it."""
    if _state["quiet"] or not _err_terminal():
        done = [0]

        def line(t: float) -> str:
            rate = f", {done[0] / t:.1f} {unit}/s" if done[0] and t > 0 else ""
            return f"{done[0]:,} {unit} done{rate}, {elapsed(t)}: {message}"

        def one_more() -> None:
            done[0] += 1

        with plain_progress(line):
            yield one_more
        return
    from rich.progress import (
        Progress,
        ProgressColumn,
        SpinnerColumn,
        Task,
        TextColumn,
        TimeElapsedColumn,
    )
    from rich.table import Column
    from rich.text import Text

    class Rate(ProgressColumn):
        def render(self, task: Task) -> Text:
            speed = task.finished_speed or task.speed
            return Text(f"{speed:.1f} {unit}/s" if speed else "", style="dim")

    columns = (
        SpinnerColumn(),
        TextColumn("{task.completed:.0f} " + unit),
        Rate(),
        TimeElapsedColumn(),
        # What is left of the line, its end cut short first: a long path never hides the count.
        TextColumn(
            "{task.description}",
            markup=False,
            table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis"),
        ),
    )
    with Progress(*columns, console=_err(), transient=True, expand=True) as bar:
        task = bar.add_task(_shown(message).plain, total=None)
        yield lambda: bar.advance(task)


@contextmanager
def byte_bar(message: str, total: int) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr for a large download (on a terminal, as huggingface_hub shows one;
    off one, a plain line every PLAIN_EVERY seconds; neither with --quiet); yields the function
    that counts bytes received."""
    if _state["quiet"] or not _err_terminal():
        got = [0]

        def line(t: float) -> str:
            share = f" ({100 * got[0] / total:.0f}%)" if total else ""
            return f"{message}: {binary_size(got[0])} of {binary_size(total)}{share}, {elapsed(t)}"

        def received(n: int) -> None:
            got[0] += n

        with plain_progress(line):
            yield received
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=_err(), transient=True) as bar:
        task = bar.add_task(_shown(message).plain, total=total)
        yield lambda n: bar.advance(task, n)


ranges.set_progress(byte_bar)


@contextmanager
def tokens_bar(message: str, unit: str) -> Iterator[Callable[[int, int], None]]:
    """A progress bar on stderr for work counted in items of a total known once it starts
    (`lens --text`'s tokens): yields `advance(done, total)`; the rate and the time left are
    taken from the first call on (what comes before it, a model's loading, is not counted).
    On a terminal a bar; off one, a plain line every PLAIN_EVERY seconds; neither with --quiet."""
    state: dict[str, float] = {"done": 0, "total": 0}

    def rate(done: int) -> float:
        now = time.monotonic()
        if "first" not in state:
            state["first"], state["first_done"] = now, done
            return 0.0
        state["rate"] = (done - state["first_done"]) / max(now - state["first"], 1e-9)
        return state["rate"]

    if _state["quiet"] or not _err_terminal():

        def line(t: float) -> str:
            done, total, per_s = int(state["done"]), int(state["total"]), state.get("rate", 0.0)
            if not total:
                return f"{message}: loading, {elapsed(t)}"
            left = f", {per_s:,.0f}/s, {elapsed((total - done) / per_s)} left" if per_s else ""
            return f"{done:,} of {total:,} {unit}{left}: {message}"

        def plain(done: int, total: int) -> None:
            rate(done)
            state["done"], state["total"] = done, total

        with plain_progress(line):
            yield plain
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    columns = (TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
               TextColumn(unit), TextColumn("{task.fields[rate]}"), TimeRemainingColumn())  # fmt: skip
    with Progress(*columns, console=_err(), transient=True) as bar:
        task = bar.add_task(_shown(message).plain, total=None, rate="")

        def advance(done: int, total: int) -> None:
            per_s = rate(done)
            shown = f"{per_s:,.0f} {unit.split()[0]}/s" if per_s else ""
            bar.update(task, completed=done, total=total, rate=shown)

        yield advance
