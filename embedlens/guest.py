"""A library call leaves the caller's process as it found it (`guest`, around every public
function: `embedlens.__getattr__` wraps each one once).

What a call may change while it runs, and what is put back on return and on error alike:

- environment variables: every one, as it was (added ones removed, changed ones set back);
- log levels: every logger that existed before the call, and the levels embedlens set on
  loggers made during it (transformers', huggingface_hub's and accelerate's, when the call is
  what imported them: `keep` records what they were just before);
- progress bars: transformers' and huggingface_hub's switches, as they were;
- the garbage collector: its thresholds and whether it runs;
- torch's intra-op threads, where torch was already imported (a call that sets them sets them
  back itself; interop threads can be set once a process, so no call sets them).

The C allocator's settings are not here: glibc's `mallopt` has no getter, so nothing could put
back a value the caller set. A library call never calls it; only the command line, which owns
its process, does (`runtime.own_process`, `runtime.heap_kept`). Calls nest, and may run at once
in several threads: the first to start takes the snapshot, the last to end puts it back.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


@dataclass
class _Open:
    """The guest calls now open, in every thread: how many, the snapshot the first took, and
    the restores `keep` recorded in any of them (run when the last one ends)."""

    calls: int = 0
    snapshot: _Snapshot | None = None
    restores: list[Callable[[], None]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _Snapshot:
    """What `guest` puts back: see the module's docstring."""

    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    levels: dict[str, int] = field(default_factory=lambda: _levels())
    gc_threshold: tuple[int, int, int] = field(default_factory=gc.get_threshold)
    gc_enabled: bool = field(default_factory=gc.isenabled)
    torch_threads: int | None = field(default_factory=lambda: _torch_threads())
    bars: dict[str, bool] = field(default_factory=lambda: _bars())

    def restore(self) -> None:
        """Put back what was taken (only what differs is written)."""
        for name in [n for n in os.environ if n not in self.environ]:
            del os.environ[name]
        for name, value in self.environ.items():
            if os.environ.get(name) != value:
                os.environ[name] = value
        loggers = logging.Logger.manager.loggerDict
        for name, level in self.levels.items():
            logger = loggers.get(name) if name else logging.getLogger()
            if isinstance(logger, logging.Logger) and logger.level != level:
                logger.setLevel(level)
        if gc.get_threshold() != self.gc_threshold:
            gc.set_threshold(*self.gc_threshold)
        if gc.isenabled() != self.gc_enabled:
            (gc.enable if self.gc_enabled else gc.disable)()
        if self.torch_threads is not None and _torch_threads() != self.torch_threads:
            sys.modules["torch"].set_num_threads(self.torch_threads)
        for name, on in self.bars.items():
            if _bars().get(name) != on:
                _BAR_SETTERS[name](on)


def _levels() -> dict[str, int]:
    """Every logger's own level ('' the root's)."""
    found = {"": logging.getLogger().level}
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger):
            found[name] = logger.level
    return found


def _torch_threads() -> int | None:
    """torch's intra-op threads where torch is imported, else None."""
    torch = sys.modules.get("torch")
    threads = getattr(torch, "get_num_threads", None)
    return int(threads()) if threads is not None else None


def _bars() -> dict[str, bool]:
    """Whether transformers' and huggingface_hub's progress bars are on, for each one imported
    (their public switches)."""
    found: dict[str, bool] = {}
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None and hasattr(hf_logging, "is_progress_bar_enabled"):
        found["transformers"] = bool(hf_logging.is_progress_bar_enabled())
    hub_tqdm = sys.modules.get("huggingface_hub.utils.tqdm")
    if hub_tqdm is not None and hasattr(hub_tqdm, "are_progress_bars_disabled"):
        found["huggingface_hub"] = not hub_tqdm.are_progress_bars_disabled()
    return found


def _transformers_bars(on: bool) -> None:
    from transformers.utils import logging as hf_logging

    if on:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()


def _hub_bars(on: bool) -> None:
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    (enable_progress_bars if on else disable_progress_bars)()


_BAR_SETTERS: dict[str, Callable[[bool], None]] = {
    "transformers": _transformers_bars,
    "huggingface_hub": _hub_bars,
}


_OPEN = _Open()


@contextmanager
def guest() -> Iterator[None]:
    """The block runs as a guest: the process is put back as it was when the block ends, on
    return and on error (see the module's docstring). Blocks open at once, nested or in other
    threads, leave it to the last to end: the process is put back as the first found it."""
    with _OPEN.lock:
        _OPEN.calls += 1
        if _OPEN.calls == 1:
            _OPEN.snapshot, _OPEN.restores = _Snapshot(), []
    try:
        yield
    finally:
        with _OPEN.lock:
            _OPEN.calls -= 1
            if _OPEN.calls == 0 and _OPEN.snapshot is not None:
                for restore in reversed(_OPEN.restores):
                    restore()
                _OPEN.snapshot.restore()
                _OPEN.snapshot = None


def keep(restore: Callable[[], None]) -> None:
    """Inside a guest call, `restore` runs when the call ends (the last of those open, before
    the snapshot is put back): for a setting of a library the call itself imported, which the
    snapshot could not see. Outside one (the command line, which owns its process) nothing is
    recorded."""
    with _OPEN.lock:
        if _OPEN.calls:
            _OPEN.restores.append(restore)


def quietly_kept() -> None:
    """Record transformers', huggingface_hub's and accelerate's log levels and progress bars as
    they are now, to be put back when the guest call ends (`keep`): what `quiet` and `quiet_hub`
    call before they silence them."""
    if not _OPEN.calls:
        return
    levels = {name: logging.getLogger(name).level for name in _QUIETED}
    bars = _bars()

    def restore() -> None:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        for name, on in bars.items():
            if _bars().get(name) != on:
                _BAR_SETTERS[name](on)

    keep(restore)


_QUIETED = ("transformers", "huggingface_hub", "accelerate")
"""The library loggers embedlens silences while it reads a model."""


def as_guest(func: Callable[P, R]) -> Callable[P, R]:
    """`func` run inside `guest` (what `embedlens.<function>` is)."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with guest():
            return func(*args, **kwargs)

    return wrapper
