"""One progress protocol for every long call (`lens_prompts`, `tune`, ...).

A long call takes `progress=`, a callable it calls as work advances:

    progress(stage, done, total, unit, detail="")

`stage` names the step ('prompts', 'fitting', 'refining', 'evaluating'), `done` and `total`
count `unit`s ('prompts', 'tokens', 'steps'); a `total` of 0 is not known in advance;
`detail` is a short text on the step's latest state (tune's refinement: the KL by layers).
Under torchrun the counts cover every process.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any, Protocol


class Progress(Protocol):
    """What a long call calls as work advances."""

    def __call__(
        self, stage: str, done: int, total: int, unit: str, detail: str = "", /
    ) -> None: ...


def no_progress(stage: str, done: int, total: int, unit: str, detail: str = "") -> None:
    """The progress of a call given none."""


def progress_of(fn: Callable[..., Any] | None, function: str) -> Progress:
    """`fn` as a `Progress` (None: `no_progress`); the former shape of `tune`'s,
    `progress(phase, done, total, detail)`, is taken with a DeprecationWarning."""
    if fn is None:
        return no_progress
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable Python cannot read the parameters of
        return fn
    try:  # the protocol's parameters are positional: a callable may name them as it likes
        signature.bind("stage", 0, 0, "unit", "")
    except TypeError:
        try:
            signature.bind("stage", 0, 0, "detail")
        except TypeError:
            return fn  # let the call say what is wrong
        warnings.warn(
            f"{function}(progress=...) is now called as progress(stage, done, total, unit, "
            "detail=''): a callable of four parameters (phase, done, total, detail) is "
            "deprecated",
            DeprecationWarning,
            stacklevel=3,
        )
        old = fn

        def adapted(stage: str, done: int, total: int, unit: str, detail: str = "") -> None:
            old(stage, done, total, detail)

        return adapted
    return fn
