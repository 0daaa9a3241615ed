"""Process tuning, in one place: BLAS threads, the C heap's thresholds, other processes' load.

None of it changes a figure, only how fast it comes, and none of it overrides what the user set.
The first two change the process for good, so only the command line, which owns its process,
takes them (`own_process()`, called by its entry point); a library call leaves the caller's
process as it found it (`embedlens.guest`) and gets neither:

- `one_blas_thread()`: numpy's BLAS on one thread for the commands whose work is many small
  products (`neighbors`, `vocab`), set through `OPENBLAS_NUM_THREADS` only where the user has not
  set it, and only while numpy is not yet imported (after that it is too late: nothing changes);
- `heap_kept()`: freed memory kept in the process while a long run allocates and frees large
  arrays (glibc's thresholds; `mallopt` has no getter, so what they were cannot be put back);
- `world()`: this process's rank and the number of processes under torchrun (read from the
  environment, so that a run alone never imports `embedlens.analysis.dist`).

This module imports nothing heavy: `embedlens` consults it before a command's module loads.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# --- BLAS threads ----------------------------------------------------------------------------

BLAS_THREADS = "OPENBLAS_NUM_THREADS"
"""The variable numpy's BLAS (OpenBLAS, as numpy's wheels ship it) reads its thread count from."""
ONE_BLAS_THREAD = frozenset({"neighbors", "vocab"})
"""Commands whose work is [block, d] x [d, few] products: BLAS threads cost more than they give
(0.73 s against 0.20 s for `neighbors` on Qwen3-0.6B's table on two busy cores)."""


_owned: list[bool] = []
"""Whether the command line owns this process (`own_process`)."""


def own_process() -> None:
    """The command line's entry point owns its process: the tuning here may be applied."""
    _owned[:] = [True]


def owns_process() -> bool:
    """Whether the process is the command line's (else a library call's guest)."""
    return bool(_owned)


def one_blas_thread() -> bool:
    """Ask numpy's BLAS for one thread: `OPENBLAS_NUM_THREADS=1` unless the variable is set
    (a value the user set wins, whatever it is). Returns whether BLAS can still take it.

    OpenBLAS reads the variable once, when numpy is first imported. When numpy is already
    imported (by the caller, or by an earlier command in the same process) it is too late:
    nothing is changed, neither the variable (which would only mislead child processes) nor BLAS,
    which keeps the threads it started with. The figures are the same either way; only the time
    differs. To get one thread then, set `OPENBLAS_NUM_THREADS=1` before starting Python.
    """
    if "numpy" in sys.modules:
        return False
    os.environ.setdefault(BLAS_THREADS, "1")
    return True


def tune_for_command(command: str) -> None:
    """Tune the process for `command` before its module (and numpy with it) is imported, where
    the command line owns the process: `embedlens.<command>` calls this when the function is
    first looked up (the command line looks its function up the same way). In a library call
    it does nothing: the caller's environment is the caller's."""
    if command in ONE_BLAS_THREAD and owns_process():
        one_blas_thread()


# --- Freed memory kept in the process --------------------------------------------------------
#
# torch on the CPU allocates every output afresh, and glibc hands a freed block above its mmap
# threshold (32 MiB at most) straight back to the kernel, and trims the heap's free top, so a run
# that decodes hundreds of [rows, V] chunks pays the kernel's page faults for each one again.
# Measured on the Qwen3-0.6B-shaped checkpoint (100 prompts, float32, 2 cores): 29.7 s and 2.7
# million minor page faults as glibc sets itself, 21.4 s and 0.93 million with both thresholds
# raised; the peak resident memory was the same (3.88 GB).

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
    import ctypes

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
def heap_kept() -> Iterator[bool]:
    """Freed blocks stay in the heap for the block's length; yields whether glibc took it.

    glibc's mmap and trim thresholds are raised for the length of a run, and afterwards set where
    glibc's own dynamic threshold ends up once large blocks have been freed (32 MiB, and twice
    that for trimming); then the heap's free memory goes back to the kernel. Elsewhere than on
    glibc, and outside the command line (`own_process`), it does nothing: the thresholds have no
    getter, so a caller's own could not be put back."""
    if not owns_process():
        yield False
        return
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


# --- torchrun --------------------------------------------------------------------------------


def world() -> tuple[int, int]:
    """This process's rank and the number of processes, as torchrun sets them (`RANK`,
    `WORLD_SIZE`); (0, 1) alone, or when they are not whole numbers."""
    try:
        size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0, 1
    if size <= 1 or not 0 <= rank < size:
        return 0, 1
    return rank, size
