"""Freed memory kept in the process while a long run allocates and frees large arrays.

torch on the CPU allocates every output afresh, and glibc hands a freed block above its mmap
threshold (32 MiB at most) straight back to the kernel, and trims the heap's free top, so a run
that decodes hundreds of [rows, V] chunks pays the kernel's page faults for each one again.
Measured on the Qwen3-0.6B-shaped checkpoint (100 prompts, float32, 2 cores): 29.7 s and 2.7
million minor page faults as glibc sets itself, 21.4 s and 0.93 million with both thresholds
raised; the peak resident memory was the same (3.88 GB).

`kept()` raises them for the length of a run and afterwards sets them where glibc's own dynamic
threshold ends up once large blocks have been freed (32 MiB, and twice that for trimming), then
returns the heap's free memory to the kernel. Elsewhere than on glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
KEEP_BELOW = 2**30
"""During a run, blocks below 1 GiB come from and go back to the heap."""
AFTER_MMAP = 32 * 2**20
AFTER_TRIM = 2 * AFTER_MMAP

_active: list[bool] = []
"""Whether each run now open had glibc take the thresholds (runs nest: the outermost sets them)."""


def _glibc() -> Any:
    """The C library's functions when it is glibc, else None."""
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):
        return None
    if not version or not version.startswith("glibc"):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    if not hasattr(libc, "mallopt") or not hasattr(libc, "malloc_trim"):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return libc


@contextmanager
def kept() -> Iterator[bool]:
    """Freed blocks stay in the heap for the block's length; yields whether glibc took it."""
    if _active:
        _active.append(_active[-1])
        try:
            yield _active[-1]
        finally:
            _active.pop()
        return
    libc = _glibc()
    took = libc is not None and bool(
        libc.mallopt(M_MMAP_THRESHOLD, KEEP_BELOW) and libc.mallopt(M_TRIM_THRESHOLD, KEEP_BELOW)
    )
    _active.append(took)
    try:
        yield took
    finally:
        _active.pop()
        if libc is not None:
            libc.mallopt(M_MMAP_THRESHOLD, AFTER_MMAP)
            libc.mallopt(M_TRIM_THRESHOLD, AFTER_TRIM)
            libc.malloc_trim(0)
