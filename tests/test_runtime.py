"""Process tuning (`embedlens.runtime`): BLAS threads, the C heap's thresholds, other processes'
load."""

from __future__ import annotations

import ctypes
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from embedlens import runtime
from tests import busy
from tests.busy import OthersBusy, Reading, others_between

# --- BLAS threads ------------------------------------------------------------------------------

# A process's BLAS thread count as OpenBLAS itself reports it, printed with the variable after the
# snippet given runs (None where numpy's BLAS is not an OpenBLAS this can ask).
_REPORT = """\
import atexit, ctypes, json, os, sys

def report():
    threads = None
    for line in open("/proc/self/maps"):
        path = line.split()[-1]
        if "openblas" in path.lower() and ".so" in path:
            lib = ctypes.CDLL(path)
            for name in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_",
                         "openblas_get_num_threads"):
                if hasattr(lib, name):
                    threads = getattr(lib, name)()
                    break
            break
    var = os.environ.get("OPENBLAS_NUM_THREADS")
    sys.stderr.write(json.dumps({"threads": threads, "var": var, "numpy": "numpy" in sys.modules}))

atexit.register(report)
"""


def _blas(snippet: str, *args: str, **env: str) -> dict[str, object]:
    """OpenBLAS's threads and OPENBLAS_NUM_THREADS once `snippet` has run in a fresh process
    (OMP_NUM_THREADS, which OpenBLAS reads too, unset: a test worker's share is not a caller's)."""
    unset = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
    clean = {k: v for k, v in os.environ.items() if k not in unset}
    result = subprocess.run(
        [sys.executable, "-c", _REPORT + snippet, *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report: dict[str, object] = json.loads(result.stderr.strip().splitlines()[-1])
    assert report["numpy"], "the snippet did not import numpy"
    return report


def _one_thread_where_openblas(report: dict[str, object]) -> None:
    assert report["var"] == "1"
    if report["threads"] is not None:
        assert report["threads"] == 1


@pytest.mark.parametrize("command", ["neighbors", "vocab"])
def test_the_python_api_leaves_blas_to_the_caller(command):
    """embedlens.neighbors and embedlens.vocab from Python set no variable: the caller's
    process is the caller's (the figures do not depend on BLAS's threads)."""
    assert _blas(f"import embedlens\nembedlens.{command}\nimport numpy\n")["var"] is None
    assert _blas(f"from embedlens import {command}\nimport numpy\n")["var"] is None


@pytest.mark.slow  # two whole command-line processes
def test_the_command_line_runs_numpys_blas_on_one_thread(tiny):
    model = str(tiny("llama-tied"))
    cli = "import sys\nfrom embedlens.cli import main\nsys.argv = sys.argv[1:]\nmain()\n"
    _one_thread_where_openblas(_blas(cli, "embedlens", "neighbors", model, "king", "--json"))
    _one_thread_where_openblas(_blas(cli, "embedlens", "vocab", model, "--json"))


def test_a_value_the_user_set_wins():
    owned = "from embedlens import runtime\nruntime.own_process()\n"
    report = _blas(owned + "import embedlens\nembedlens.vocab\n", OPENBLAS_NUM_THREADS="2")
    assert report["var"] == "2"
    if report["threads"] is not None and (os.cpu_count() or 1) >= 2:
        assert report["threads"] == 2


def test_once_numpy_is_imported_nothing_changes():
    """Too late: BLAS keeps the threads it started with, and the variable is left unset."""
    snippet = (
        "import numpy\nimport embedlens\nfrom embedlens import runtime\nruntime.own_process()\n"
        "embedlens.neighbors\nassert runtime.one_blas_thread() is False\n"
    )
    report = _blas(snippet)
    assert report["var"] is None
    if report["threads"] is not None and (os.cpu_count() or 1) >= 2:
        assert report["threads"] > 1


def test_other_commands_leave_blas_alone():
    """params, tied, addr and lens keep numpy's default (their figures are not BLAS-bound)."""
    report = _blas("import embedlens\nembedlens.addr\nimport numpy\n")
    assert report["var"] is None


# --- Freed memory kept in the process (glibc's thresholds raised) -----------------------------

BLOCK = 64 * 2**20  # above glibc's largest dynamic mmap threshold
PAGES = BLOCK // 4096

glibc = pytest.mark.skipif(runtime._glibc() is None, reason="needs glibc")


@pytest.fixture
def owned(monkeypatch):
    """This process taken for the command line's (`runtime.own_process`), for the test alone."""
    monkeypatch.setattr(runtime, "_owned", [True])


def _faults(n: int) -> int:
    """Minor page faults of allocating, filling and freeing n blocks in turn (with glibc's
    malloc: what the thresholds govern)."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        block = libc.malloc(BLOCK)
        assert block
        ctypes.memset(block, 1, BLOCK)
        libc.free(block)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _resident() -> int:
    """This process's resident memory, in bytes."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize()


@glibc
def test_freed_blocks_are_reused_while_kept_and_returned_after(owned):
    with runtime.heap_kept() as took:
        assert took
        _faults(1)  # the first block is new memory
        inside = _faults(4)
        held = _resident()
    assert inside < PAGES // 2, inside  # four blocks, one block's pages at most
    assert held - _resident() >= BLOCK * 0.9  # the freed block went back to the kernel


@glibc
def test_nested_runs_leave_the_thresholds_to_the_outer_one(owned):
    with runtime.heap_kept() as outer:
        with runtime.heap_kept() as inner:
            assert inner == outer
        _faults(1)
        assert _faults(4) < PAGES // 2  # the inner run's end did not undo the outer one


def test_a_library_call_leaves_the_thresholds_alone():
    """Outside the command line the thresholds are never set (they have no getter: a caller's
    own could not be put back)."""
    assert not runtime.owns_process()
    with runtime.heap_kept() as took:
        assert not took


def test_elsewhere_than_glibc_nothing_is_changed(monkeypatch, owned):
    monkeypatch.setattr(runtime, "_glibc", lambda: None)
    with runtime.heap_kept() as took:
        assert not took


# --- Other processes' load: the machine's CPU time less this process's own ---------------------


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
        ticks = round(busy_s * busy._TICK)
        stat.write_text(f"cpu  {ticks - 7} 0 7 123456 89 0 0 0 0 0\ncpu0 1 2 3 4\n")

    monkeypatch.setattr(busy, "PROC_STAT", str(stat))
    monkeypatch.setattr(busy, "time", clock)
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
    monkeypatch.setattr(busy, "PROC_STAT", "/nonexistent/stat")
    monkeypatch.setattr(os, "getloadavg", lambda: (7.0, 7.0, 7.0), raising=False)
    cores = OthersBusy()()
    assert 7.0 - (os.cpu_count() or 1) <= cores <= 7.0
