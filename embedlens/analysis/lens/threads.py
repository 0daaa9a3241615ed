"""How many CPU threads torch uses for a lens run, and one thread where the bytes depend on it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from embedlens.analysis.lens.blocks import input_device

SMALL_WORK = 4e9
"""Parameters x tokens below which the lens runs on one CPU thread (see `threads_for`)."""


@contextmanager
def threads_for(model: nn.Module, n_tokens: int) -> Iterator[None]:
    """One CPU thread for a small forward pass, torch's own setting otherwise: chosen from the
    work's size alone, never from the machine's load, since the thread count can move the last
    bits of a forward pass (seen on SmolLM2: 2 of 64 prompts' rows in a batch on two threads) and
    a figure must not depend on what else the machine runs.

    A short prompt through a small model is hundreds of thin matmuls; with several threads each
    one ends in a barrier that waits for a time slice when the other cores are busy (measured on
    2 busy cores: SmolLM2 on 5 tokens, 0.15 s on one thread, 1.5 to 3.6 s on two).
    """
    on_cpu = input_device(model).type == "cpu"
    work = sum(p.numel() for p in model.parameters()) * n_tokens
    if not on_cpu or torch.get_num_threads() == 1 or work >= SMALL_WORK:
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
