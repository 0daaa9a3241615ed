"""One error policy: an `error:` line, maybe a `hint:` line, the contract's exit code."""

from __future__ import annotations

import functools
import traceback
import warnings
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import typer

from embedlens.cli._output import err_console, silence_stdout
from embedlens.errors import EmbedlensError, UsageError
from embedlens.text import debug_enabled, one_line
from embedlens.views.format import shown

P = ParamSpec("P")
R = TypeVar("R")


def print_error(message: str, hint: str | None = None) -> None:
    """Print `error: ...` (and `hint: ...`) on stderr, one line each, control characters escaped."""
    err_console.print(shown("error: " + one_line(message), style="red"), soft_wrap=True)
    if hint:
        err_console.print(shown("hint: " + one_line(hint), style="dim"), soft_wrap=True)


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
            print_error(e.message, e.hint)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            raise typer.Exit(130) from None
        except BrokenPipeError:
            silence_stdout()
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
