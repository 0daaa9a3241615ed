"""The model as a tuning run reads it: its blocks, its own decoder (self-checked), and one forward
pass per sequence on the CPU threads the work's size calls for.

A reader is made on a sequence: before any statistic is taken, the model's own decoder must
reproduce the model's logits there from the last block's output (the lens's self-check): a tuned
lens decodes through it, and one fitted through a tail that is not the model's would not be
faithful.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from embedlens.analysis.lens.blocks import (
    Capture,
    ModelDecoder,
    capture,
    find_blocks,
    input_device,
    threads_for,
)
from embedlens.analysis.lens.engine import tolerance
from embedlens.errors import UnsupportedError


class Reader:
    """One model's blocks, the device its input goes to, and its own decoder, checked on the
    sequence the reader is made on.

    A pass runs on the CPU threads the lens chooses for its tokens (one for small work): from
    the work's size alone, never from the machine's load, so that the lens folder's bytes do not
    depend on what else the machine runs (on 2 busy cores at load 5, two threads took 481 CPU
    seconds where one took 201: set OMP_NUM_THREADS=1 on a shared machine)."""

    def __init__(self, model: nn.Module, ids: list[int]) -> None:
        """The model read, its own decoder checked on the sequence `ids` (UnsupportedError
        where it does not reproduce the model's logits)."""
        self.model = model
        self.blocks = find_blocks(model)
        self.n_layers = len(self.blocks.modules)
        self.device = input_device(model)
        """Where input ids and decoded rows go."""
        self.own, self.vocab_rows = self._checked(ids)
        """The model's own decoder, found faithful; the rows of the model's output."""

    @contextmanager
    def read(
        self,
        ids: list[int],
        rows: Sequence[int] | None = None,
        *,
        layers: Sequence[int] | None = None,
        logits: bool = True,
        graph: bool = False,
    ) -> Iterator[Capture]:
        """One forward pass on a sequence, inside inference mode and its threads: the residual
        at `layers` (0..L by default) and the logits at positions `rows` (all by default).
        `logits=False`: the residual alone. `graph`: no_grad for inference mode, so that the
        tensors may enter a graph (the refinement's)."""
        read = list(range(len(ids))) if rows is None else list(rows)
        layers = range(self.n_layers + 1) if layers is None else layers
        mode = torch.no_grad() if graph else torch.inference_mode()
        with mode, threads_for(self.model, len(ids)):
            yield capture(self.model, self.blocks, [ids], [read], layers, logits=logits)

    def _checked(self, ids: list[int]) -> tuple[ModelDecoder, int]:
        """The model's own decoder, where it reproduces the model's logits on `ids` from the
        last block's output (cutting the block list, else with every block in place), or
        UnsupportedError; and the rows of the model's output."""
        model, n = self.model, self.n_layers
        with self.read(ids, layers=[n]) as cap:
            assert cap.logits is not None
            own = ModelDecoder(model, self.blocks, dummy_id=int(ids[0]))
            tol = tolerance(next(model.parameters()).dtype, cap.logits)
            diff = math.inf
            for full in (False, True):
                own.full = full
                rows = cap.residual[n][:16].to(self.device)
                mine = own.logits(rows, [n] * len(rows)).float().to(cap.logits.device)
                diff = float((mine - cap.logits[: len(rows)]).abs().max())
                if diff <= tol:
                    return own, int(cap.logits.shape[-1])
        raise UnsupportedError(
            f"decoding the last block's output does not reproduce this model's logits (max |Δ| "
            f"= {diff:.3g} > {tol:.3g}): a lens decoded through the model's own steps would not "
            "be faithful, so none is tuned",
            hint="`embedlens lens MODEL PROMPT` names the suspect step",
        )
