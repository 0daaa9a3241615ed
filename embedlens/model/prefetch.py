"""A folder's half-precision weights copied to float32 on a thread of their own, while the main
thread imports transformers and builds the model on the meta device.

The direct load (`direct.load_float32`) converts each bfloat16 or float16 tensor of the
checkpoint to float32 as it assigns it: on SmolLM2 and Qwen3-0.6B the copies are a third of the
load, and the imports and the build before them leave the second core idle. The copies are the
same elementwise conversions `Tensor.to(torch.float32)` makes (exact: every bfloat16 and float16
value is a float32 value), so the weights are the same bits whichever thread made them. The
thread runs torch's batched copy (`_foreach_copy_`), which holds no GIL, on pieces of torch's
grain size, which torch never splits between threads: the copies take one core without the
thread setting torch's thread count (process-wide state, the main thread's to set). A call copies
a few pieces, so that a load that ends early (`close`) waits for one call at most.

Like `loading`, nothing here imports torch at module level.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CONVERTED = ("BF16", "F16")
"""safetensors dtypes that the load converts to float32 (a float32 tensor is used as it is read)."""
PIECE = 2**15
"""Elements a copy converts at once: torch's grain size (`at::internal::GRAIN_SIZE`), up to which
an elementwise op runs on the calling thread alone (were it smaller in another torch release, a
piece would be split between threads: the same bits, at another speed)."""
PER_CALL = 64
"""Pieces copied by one call of the thread (2 Mi elements): a stop is seen between calls."""


def worth_it() -> bool:
    """Whether a second thread can run beside the main one: this process may use more than one
    core (a fact of the machine, not of its load; on one core the copies would only take turns
    with the imports)."""
    try:
        return len(os.sched_getaffinity(0)) > 1
    except (AttributeError, OSError):
        return (os.cpu_count() or 1) > 1


@contextmanager
def copies_for(files: list[Path] | None) -> Iterator[Prefetch | None]:
    """The float32 copies of `files`' half-precision weights (those a direct load will read:
    `direct.early_files`), begun on a second thread where the process may use two cores
    (`worth_it`): None elsewhere, for no files, and where the files cannot be opened (the load
    then says why). Waited for and let go of on the way out."""
    early = None
    if files is not None and worth_it():
        try:
            early = Prefetch(files)
        except Exception:  # a broken file: the load reports it as it does without this
            early = None
    try:
        yield early
    finally:
        if early is not None:
            early.close()


class Prefetch:
    """float32 copies of the files' bfloat16 and float16 tensors, made on a second thread from
    the moment it is built; `take` waits for them."""

    def __init__(self, files: list[Path]) -> None:
        import torch
        from safetensors import safe_open

        self._handles: list[Any] = []
        self._copies: dict[tuple[Path, str], Any] = {}
        pairs: list[tuple[Any, Any]] = []
        for path in files:
            handle: Any = safe_open(str(path), framework="pt", device="cpu")
            self._handles.append(handle)
            keys = list(handle.keys())
            for key in keys:
                part = handle.get_slice(key)
                if part.get_dtype() not in CONVERTED:
                    continue
                source = part[...]  # the memory-mapped bytes, not read yet
                copy = torch.empty(source.shape, dtype=torch.float32)
                pairs.append((source, copy))
                self._copies[(path, key)] = copy
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(pairs,), name="embedlens-prefetch", daemon=True
        )
        self._thread.start()

    def _run(self, pairs: list[tuple[Any, Any]]) -> None:
        """Copy the pairs, PER_CALL pieces at a time, each piece on this thread alone (a copy is
        bound by the fresh pages it touches: see `direct._one_thread`)."""
        from embedlens.compat.torch import batched_copy

        # torch's batched copy is private: taken on the releases it was measured on, else each
        # piece is copied by the public `copy_` (the same elementwise conversion, the same bits)
        batched = batched_copy()
        step = PIECE * PER_CALL
        try:
            for source, copy in pairs:
                whole, into = source.reshape(-1), copy.view(-1)
                for start in range(0, whole.numel(), step):
                    if self._stop.is_set():
                        return
                    sources = whole[start : start + step].split(PIECE)
                    copies = into[start : start + step].split(PIECE)
                    if batched is not None:
                        batched(list(copies), list(sources))
                    else:
                        for piece, target in zip(sources, copies, strict=True):
                            target.copy_(piece)
        except BaseException as e:  # the load then reads the tensors itself
            self._error = e

    def take(self, path: Path, key: str, dtype: Any) -> Any | None:
        """The float32 copy of `key` in `path` once it is made (None when the load should read
        it itself: not converted here, another dtype wanted, or the copies failed)."""
        self._thread.join()
        if self._error is not None:
            self._copies.clear()
        import torch

        if dtype != torch.float32:
            return None
        return self._copies.pop((path, key), None)

    def close(self) -> None:
        """Stop copying (after the current call), wait for the thread and let go of every copy
        not taken."""
        self._stop.set()
        self._thread.join()
        self._copies.clear()
        self._handles.clear()
