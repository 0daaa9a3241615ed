"""torchrun's seam: whether a call runs split over processes, and its session if so.

`lens_prompts` and `tune` ask here (`split_session`) and pass the `dist.Session` they get to
what splits the work; the command line makes the same session first (`cli_session`), so that its
error policy says a failure once, from rank 0. Run alone (WORLD_SIZE unset or 1) nothing here
imports `embedlens.analysis.dist` (nor starts a process group): every answer is None.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from embedlens.errors import UsageError
from embedlens.runtime import world

if TYPE_CHECKING:
    from embedlens.analysis.dist import Session
    from embedlens.model.prompts import PromptSource
    from embedlens.options import LoadOptions


def split_session(backend: str, device: str, alone_only: str | None = None) -> Session | None:
    """Under torchrun (WORLD_SIZE above 1): this process's session, its process group joined
    for a new run; None alone. `alone_only`: what in the call runs in one process only (it is
    refused under torchrun)."""
    if world()[1] == 1:
        return None
    from embedlens.analysis import dist

    dist.check_backend(backend)
    if alone_only is not None:
        raise UsageError(
            f"under torchrun, lens --prompts runs the prompts split over processes: {alone_only} "
            "runs in one process only",
            hint="run it without torchrun",
        )
    return dist.join(backend, device)


def lens_session(
    backend: str, load: LoadOptions, source: PromptSource, against: object
) -> Session | None:
    """`lens_prompts`'s session (`split_session`): a pair, a model over several devices and
    prompts from stdin run in one process only."""
    what = None
    if against is not None:
        what = "--against (two models in turn, on one machine)"
    elif load.device_map is not None:
        what = "--device-map (one model over every device of the machine)"
    elif source.spool is not None:
        what = "prompts from stdin (the processes torchrun starts do not share it)"
    return split_session(backend, load.device, what)


def cli_session() -> Session | None:
    """The command line's session under torchrun, made before any work (the timeout checked,
    the store joined): another process's failure found while this one is busy elsewhere
    interrupts it (`Session.interrupt_when_stuck`); None alone."""
    if world()[1] == 1:
        return None
    from embedlens.analysis import dist

    dist.timeout()  # a bad EMBEDLENS_DIST_TIMEOUT is refused before any work
    session = dist.connect()
    session.interrupt_when_stuck = True
    return session
