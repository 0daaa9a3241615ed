"""Freed memory kept in the process during a many-prompt run (glibc's thresholds raised)."""

from __future__ import annotations

import ctypes
import resource
from pathlib import Path

import pytest

from embedlens.analysis import heap

BLOCK = 64 * 2**20  # above glibc's largest dynamic mmap threshold
PAGES = BLOCK // 4096

glibc = pytest.mark.skipif(heap._glibc() is None, reason="needs glibc")


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
def test_freed_blocks_are_reused_while_kept_and_returned_after():
    with heap.kept() as took:
        assert took
        _faults(1)  # the first block is new memory
        inside = _faults(4)
        held = _resident()
    assert inside < PAGES // 2, inside  # four blocks, one block's pages at most
    assert held - _resident() >= BLOCK * 0.9  # the freed block went back to the kernel


@glibc
def test_nested_runs_leave_the_thresholds_to_the_outer_one():
    with heap.kept() as outer:
        with heap.kept() as inner:
            assert inner == outer
        _faults(1)
        assert _faults(4) < PAGES // 2  # the inner run's end did not undo the outer one


def test_elsewhere_than_glibc_nothing_is_changed(monkeypatch):
    monkeypatch.setattr(heap, "_glibc", lambda: None)
    with heap.kept() as took:
        assert not took
