"""How many CPU threads torch uses for a lens run, and one thread where the bytes depend on it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from embedlens.analysis.lens.blocks import input_device

SMALL_WORK = 4e9
"""Parameters x tokens below which the lens runs on one CPU thread (see `threads_for`)."""


@contextmanager
def threads_for(
    model: nn.Module, n_tokens: int, others_busy: Callable[[], float] | None = None
) -> Iterator[None]:
    """One CPU thread for a small forward pass, the default otherwise; with `others_busy`
    (cores other processes keep busy, asked only for large work), one thread for large work too
    while that reaches torch's thread count.

    A short prompt through a small model is hundreds of thin matmuls; with several threads each
    one ends in a barrier, and on a machine whose other cores are busy every barrier waits for a
    time slice (measured on 2 busy cores: SmolLM2 on 5 tokens, 0.15 s on one thread, 1.5 to 3.6 s
    on two; 100 prompts at load 4.0 to 5.8: 60 s wall on one thread, 86 to 97 s on two). Large
    work keeps torch's own setting unless the cores are busy.
    """
    on_cpu = input_device(model).type == "cpu"
    work = sum(p.numel() for p in model.parameters()) * n_tokens
    before = torch.get_num_threads()
    large = work >= SMALL_WORK
    if not on_cpu or before == 1 or (large and (others_busy is None or others_busy() < before)):
        yield
        return
    with one_thread():
        yield


@contextmanager
def one_thread() -> Iterator[None]:
    """torch's CPU work on one thread inside the block. A reduction whose result is a single
    value (one row's sum) is split between threads and its parts added in another order, so
    its last bits would depend on the thread count; on one thread they do not."""
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
