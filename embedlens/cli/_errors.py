"""One error policy: an `error:` line, maybe a `hint:` line, the contract's exit code."""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import typer
from rich.text import Text

from embedlens.cli._output import err_console
from embedlens.errors import EmbedlensError

P = ParamSpec("P")
R = TypeVar("R")


def debug_enabled() -> bool:
    """Whether tracebacks were asked for (--debug or EMBEDLENS_DEBUG=1)."""
    return os.environ.get("EMBEDLENS_DEBUG", "").strip().lower() in {"1", "true", "yes", "on"}


def print_error(message: str, hint: str | None = None) -> None:
    """Print `error: ...` (and `hint: ...`) on stderr, one line each."""
    one_line = " ".join(message.split())
    err_console.print(Text("error: " + one_line, style="red"), soft_wrap=True)
    if hint:
        err_console.print(Text("hint: " + " ".join(hint.split()), style="dim"), soft_wrap=True)


def handles_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Map expected failures to their exit codes; anything else is an internal error."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except EmbedlensError as e:
            if debug_enabled():
                traceback.print_exc()
            print_error(e.message, e.hint)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            raise typer.Exit(130) from None
        except BrokenPipeError:
            _silence_stdout()
            raise typer.Exit(0) from None
        except Exception as e:
            if debug_enabled():
                traceback.print_exc()
            print_error(
                f"internal error: {type(e).__name__}: {e}",
                "rerun with --debug (or EMBEDLENS_DEBUG=1) for the traceback, and report it",
            )
            raise typer.Exit(1) from None

    return wrapper


def _silence_stdout() -> None:
    """After a closed pipe, point stdout at /dev/null so the interpreter's flush stays quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
