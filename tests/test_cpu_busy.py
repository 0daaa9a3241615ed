"""Cores other processes keep busy: the machine's CPU time less this process's own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from embedlens.analysis import cpu_busy
from embedlens.analysis.cpu_busy import OthersBusy, Reading, others_between


def test_own_work_is_not_counted():
    """Two seconds of machine CPU of which this process did 1.5, over one second: 0.5 cores."""
    assert others_between(Reading(10.0, 3.0, 100.0), Reading(12.0, 4.5, 101.0)) == 0.5
    assert others_between(Reading(10.0, 3.0, 100.0), Reading(10.0, 3.5, 101.0)) == 0.0
    assert others_between(Reading(10.0, 3.0, 100.0), Reading(11.0, 3.0, 100.0)) == 0.0


class _Clock:
    """A stand-in for the `time` module: the wall clock moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_readings_of_proc_stat_less_this_process(tmp_path, monkeypatch):
    """/proc/stat and os.times() as a busy machine shows them, this process's spin not counted:
    the machine's figures are the test's own, so no other work on the machine can change them."""
    stat, clock = tmp_path / "stat", _Clock()
    own = [3.0]

    def machine(busy_s: float) -> None:  # user, nice, system, idle, iowait, irq, softirq, steal
        ticks = round(busy_s * cpu_busy._TICK)
        stat.write_text(f"cpu  {ticks - 7} 0 7 123456 89 0 0 0 0 0\ncpu0 1 2 3 4\n")

    monkeypatch.setattr(cpu_busy, "PROC_STAT", str(stat))
    monkeypatch.setattr(cpu_busy, "time", clock)
    monkeypatch.setattr(os, "times", lambda: os.times_result((own[0], 0.0, 0.0, 0.0, 0.0)))
    machine(10.0)
    others = OthersBusy()
    assert others() == 0.0  # the first window: nothing moved
    machine(11.0)
    own[0] += 1.0
    clock.now += 1.0
    assert others() == 0.0  # this process spun a core for a second: its own work
    machine(13.0)
    own[0] += 0.5
    clock.now += 1.0
    assert others() == 1.5  # two busy cores, half of one this process's


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs /proc/stat")
def test_another_process_spinning_reads_as_busy():
    """A child process that spins counts as another's load, whatever else the machine runs
    (more work elsewhere only adds to it)."""
    others = OthersBusy()
    others()
    spin = "import time\nstop = time.monotonic() + 0.6\nwhile time.monotonic() < stop: pass"
    subprocess.run([sys.executable, "-c", spin], check=True)
    assert others() > 0.2


def test_without_proc_stat_the_load_average_less_own_use(monkeypatch):
    monkeypatch.setattr(cpu_busy, "PROC_STAT", "/nonexistent/stat")
    monkeypatch.setattr(os, "getloadavg", lambda: (7.0, 7.0, 7.0), raising=False)
    busy = OthersBusy()()
    assert 7.0 - (os.cpu_count() or 1) <= busy <= 7.0
