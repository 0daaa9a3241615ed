"""Python's cyclic garbage collector held back while transformers is imported and a model built
(`fewer_collections`, `no_collections`): the objects a load makes live as long as the process."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import TYPE_CHECKING, ParamSpec, TypeVar

if TYPE_CHECKING:
    pass


YOUNG_OBJECTS = 10_000
"""Python's youngest generation while loading (its default: 700); see `fewer_collections`."""

OLDER_COLLECTIONS = 1_000_000
"""Young collections before a collection of the middle generation while loading (default: 10)."""

P = ParamSpec("P")

R = TypeVar("R")


def fewer_collections(func: Callable[P, R]) -> Callable[P, R]:
    """`func` with Python's cyclic garbage collector run less often: importing torch and
    transformers and building a model make some 380,000 objects that live as long as the
    process. With the default thresholds the collector went through the growing heap whole 6
    times while a Llama's class was imported (0.66 s of 0.82 s collecting, out of 4.5 s); with
    10,000 young objects before a collection, every object was still gone through twice, young
    and again in the middle generation (0.3 and 0.45 CPU seconds of a DeepSeek-V3 `--meta-only`
    count at load 4 to 6). While loading, only the young generation is collected (garbage is
    still collected, nothing computed depends on when), and what survives goes to the oldest
    generation after, not through the middle one again (`_survivors_to_oldest`): garbage that
    outlived a young collection waits for the oldest generation's next collection. The
    thresholds are set back after (never changed where automatic collection is off)."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        before = gc.get_threshold()
        if before[0] <= 0:
            return func(*args, **kwargs)
        gc.set_threshold(
            max(before[0], YOUNG_OBJECTS), max(before[1], OLDER_COLLECTIONS), before[2]
        )
        try:
            return func(*args, **kwargs)
        finally:
            gc.set_threshold(*before)
            _survivors_to_oldest()

    return wrapper


def no_collections(func: Callable[P, R]) -> Callable[P, R]:
    """`func` with no automatic collection: for a build on the meta device, whose tensors hold no
    memory for garbage to keep. Every object left after goes to the oldest generation
    (`_survivors_to_oldest`), the garbage of the imports with it, collected with that
    generation; collection is on again after where it was on before."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        was_on = gc.isenabled()
        gc.disable()
        try:
            return func(*args, **kwargs)
        finally:
            if was_on:
                gc.enable()
            _survivors_to_oldest()

    return wrapper


def _survivors_to_oldest() -> None:
    """Move every object the collector tracks to its oldest generation, as `gc.freeze()` then
    `gc.unfreeze()` do (two list splices: nothing is gone through). The oldest generation is
    collected whole when enough has survived there since its last collection; left in the
    middle one, the load's 380,000 objects would all be gone through at the next collection of
    it, soon after the load. Skipped when the caller has frozen objects of its own (unfreezing
    would hand them back to the collector)."""
    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()
