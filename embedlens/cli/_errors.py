"""One error policy: an `error:` line, maybe a `hint:` line, the contract's exit code."""

from __future__ import annotations

import functools
import traceback
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, ParamSpec, TypeVar

import typer

from embedlens.cli import _output
from embedlens.cli._output import silence_stdout
from embedlens.cli._scratch import TERMINATED
from embedlens.errors import EmbedlensError, RankFailed, UsageError
from embedlens.runtime import world
from embedlens.text import debug_enabled, one_line

if TYPE_CHECKING:
    from embedlens.analysis.dist import Session

P = ParamSpec("P")
R = TypeVar("R")


def print_error(message: str, hint: str | None = None) -> None:
    """Print `error: ...` (and `hint: ...`) on stderr, one line each, control characters escaped."""
    from embedlens.views.format import shown

    err_console = _output.err_console
    err_console.print(shown("error: " + one_line(message), style="red"), soft_wrap=True)
    if hint:
        err_console.print(shown("hint: " + one_line(hint), style="dim"), soft_wrap=True)


def report_error(
    message: str,
    hint: str | None = None,
    code: int = 1,
    *,
    theirs: bool = False,
    quiet: bool = False,
) -> bool:
    """Say an error (`print_error`; nothing with `quiet`: Ctrl-C). In a run split under
    torchrun, rank 0 alone says it, once: the first failure of any process (`theirs`: the
    error is another process's, `errors.RankFailed`), told through the run's store
    (`analysis.dist`); before the run has joined the store (the command line's own checks, the
    same in every process), the other processes say nothing. False when this process had
    already ended on an error."""
    rank, _ = world()
    session = _session()
    say = None if quiet else functools.partial(print_error, message, hint)
    if session is not None:
        return session.end(message, hint, code, theirs=theirs, say=say)
    if say is not None and rank == 0:
        say()
    return True


def report_terminated() -> None:
    """SIGTERM in a run split under torchrun, which ends every process once one has ended:
    rank 0 says the failure behind it, or that no process said one (killed? out of memory?)."""
    rank, _ = world()
    session = _session()
    if session is None or rank != 0:
        return
    failed = session.recorded()
    if failed is not None:
        report_error(failed.message, failed.hint, failed.exit_code, theirs=True)
        return
    report_error(
        "the run was stopped (SIGTERM): torchrun ends every process once one has ended, and "
        "none said why",
        "a process killed by the system (out of memory?) says nothing; see the launcher's report",
        TERMINATED,
        theirs=True,
    )


_attached: list[Session] = []
"""The run's session under torchrun, once the command line has made it (`attach`)."""


def attach(session: Session) -> None:
    """The run's session under torchrun, for the error policy (made by `_options.common`)."""
    _attached[:] = [session]


def _session() -> Session | None:
    """The run's session under torchrun, once attached (never alone)."""
    return _attached[0] if _attached else None


_PATH_PARAMS = {"model"}  # the file system may hold names that are not UTF-8


def check_text_arguments(kwargs: dict[str, object]) -> None:
    """Refuse text arguments that are not UTF-8 (Python keeps their bytes as lone surrogates)."""
    for name, value in kwargs.items():
        if name in _PATH_PARAMS:
            continue
        for text in value if isinstance(value, list | tuple) else [value]:
            if isinstance(text, str) and any("\udc80" <= ch <= "\udcff" for ch in text):
                raw = text.encode("utf-8", "surrogateescape")
                raise UsageError(
                    f"{raw!r} is not valid UTF-8 text",
                    hint="pass queries, prompts and tokens in UTF-8 (check the terminal's or "
                    "the script's encoding)",
                )


def handles_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Map expected failures to their exit codes; anything else is an internal error."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            check_text_arguments(kwargs)
            with warnings.catch_warnings():
                # numpy's RuntimeWarnings name a source line, not the user's problem; what
                # matters (a NaN, a zero row) is checked and said in words where it happens
                warnings.simplefilter("ignore", RuntimeWarning)
                return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except EmbedlensError as e:
            if debug_enabled():
                traceback.print_exc()
            theirs = isinstance(e, RankFailed)
            report_error(e.message, e.hint, e.exit_code, theirs=theirs)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            session = _session()
            stuck = None if session is None else session.stuck()
            if stuck is not None:  # another process failed while this one was busy elsewhere
                report_error(stuck.message, stuck.hint, stuck.exit_code, theirs=True)
                raise typer.Exit(stuck.exit_code) from None
            report_error("interrupted (Ctrl-C)", None, 130, quiet=True)
            raise typer.Exit(130) from None
        except BrokenPipeError:
            silence_stdout()
            raise typer.Exit(0) from None
        except Exception as e:
            if debug_enabled():
                traceback.print_exc()
            report_error(
                f"internal error: {type(e).__name__}: {e}",
                "rerun with --debug (or EMBEDLENS_DEBUG=1) for the traceback, and report it",
            )
            raise typer.Exit(1) from None

    return wrapper
