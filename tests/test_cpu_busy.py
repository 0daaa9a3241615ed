"""Cores other processes keep busy: the machine's CPU time less this process's own."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from embedlens.analysis import cpu_busy
from embedlens.analysis.cpu_busy import OthersBusy, Reading, others_between


def test_own_work_is_not_counted():
    """Two seconds of machine CPU of which this process did 1.5, over one second: 0.5 cores."""
    assert others_between(Reading(10.0, 3.0, 100.0), Reading(12.0, 4.5, 101.0)) == 0.5
    assert others_between(Reading(10.0, 3.0, 100.0), Reading(10.0, 3.5, 101.0)) == 0.0
    assert others_between(Reading(10.0, 3.0, 100.0), Reading(11.0, 3.0, 100.0)) == 0.0


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs /proc/stat")
def test_a_busy_thread_of_this_process_is_its_own():
    """This process spinning a core does not read as another process's load."""
    others = OthersBusy()
    others()
    stop = time.monotonic() + 0.3
    while time.monotonic() < stop:
        pass
    assert others() < 0.9


def test_without_proc_stat_the_load_average_less_own_use(monkeypatch):
    monkeypatch.setattr(cpu_busy, "PROC_STAT", "/nonexistent/stat")
    monkeypatch.setattr(os, "getloadavg", lambda: (7.0, 7.0, 7.0), raising=False)
    busy = OthersBusy()()
    assert 7.0 - (os.cpu_count() or 1) <= busy <= 7.0
