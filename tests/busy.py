"""Other work on the machine, made by the tests: processes that keep a core busy each, and a
reading of how many cores other processes keep busy (that the load made is real)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

_SPIN = "while True:\n    pass\n"


@contextmanager
def busy_processes(n: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`n` processes spinning a core each for as long as the block runs."""
    spinning = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(n)]
    try:
        yield spinning
    finally:
        for process in spinning:
            process.kill()
        for process in spinning:
            process.wait()


# --- Other processes' load -------------------------------------------------------------------
#
# The load average cannot say it: it counts this process too, so a long lens run that keeps two
# cores busy would read its own work as another process's. On Linux the machine's busy time comes
# from /proc/stat and this process's from os.times(); elsewhere the load average is all there is.

PROC_STAT = "/proc/stat"
FIRST_WINDOW_S = 0.05
"""At the first reading there is no earlier one: measure over this long (this process idle)."""
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class Reading:
    """The machine's busy CPU seconds, this process's CPU seconds, and when."""

    machine: float
    own: float
    wall: float


def read_now() -> Reading | None:
    """Now's reading, or None where /proc/stat is not there or not readable."""
    try:
        with open(PROC_STAT, encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 5:
        return None
    try:
        ticks = [int(x) for x in fields[1:9]]
    except ValueError:
        return None
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle and iowait
    busy = sum(ticks) - idle
    own = os.times()
    return Reading(busy / _TICK, own.user + own.system, time.monotonic())


def others_between(before: Reading, after: Reading) -> float:
    """Cores kept busy by other processes between two readings (never below 0)."""
    wall = after.wall - before.wall
    if wall <= 0:
        return 0.0
    others = (after.machine - before.machine) - (after.own - before.own)
    return max(0.0, others / wall)


class OthersBusy:
    """Cores other processes kept busy since the last call (the first call measures a short
    window); where /proc/stat is missing, the load average less this process's mean use."""

    def __init__(self) -> None:
        self._last: Reading | None = None

    def __call__(self) -> float:
        now = read_now()
        if now is None:
            return _from_load_average()
        if self._last is None:
            time.sleep(FIRST_WINDOW_S)
            self._last, now = now, read_now() or now
        busy = others_between(self._last, now)
        self._last = now
        return busy


_IMPORTED = time.monotonic()


def _from_load_average() -> float:
    """The 1-minute load average less this process's mean CPU use since this module loaded."""
    if not hasattr(os, "getloadavg"):
        return 0.0
    own = os.times()
    elapsed = time.monotonic() - _IMPORTED
    rate = min(float(os.cpu_count() or 1), (own.user + own.system) / elapsed) if elapsed > 1 else 0
    return max(0.0, os.getloadavg()[0] - rate)
