"""A lens folder put to use by `lens --tuned`: checked against the model's config before its
weights load, then against the loaded model, and made into the decoder the lens engine runs."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from embedlens.analysis.tune.folder import LensFolder, load_translators, open_folder
from embedlens.analysis.tune.match import check_config, check_model
from embedlens.reports.tune import TunedLens

if TYPE_CHECKING:
    from torch import nn

    from embedlens.analysis.lens.blocks import Decoder

Wrap = Callable[["Decoder"], "Decoder"]
"""Builds the lens's decoder on the model's own."""


@dataclass(frozen=True)
class Through:
    """The tuned lens ready for the engine: its decoder maker, and what reports say of it."""

    wrap: Wrap
    """Builds the tuned lens's decoder on the model's own."""
    described: TunedLens
    """What reports say of the lens (`tuned_report`, `tuned_summary`)."""


def open_tuned(path: str | os.PathLike[str]) -> LensFolder:
    """The lens folder, its config and tensors' shapes checked (no torch)."""
    return open_folder(path)


def before_load(lens: LensFolder, config: Any) -> None:
    """Refuse, before any weight is read, a lens whose size is not the model's."""
    check_config(lens, config)


def tuned_through(lens: LensFolder, model: nn.Module, tokenizer: Any) -> Through:
    """The decoder maker and the report's description of the lens, once the lens is checked
    against the loaded model (its blocks, its decoder's weights, its vocabulary)."""
    from embedlens.analysis.lens.blocks import find_blocks
    from embedlens.analysis.lens.tuned import TunedDecoder

    check_model(lens, model, find_blocks(model), tokenizer)
    translators = load_translators(lens)

    def wrap(own: Decoder) -> Decoder:
        return TunedDecoder(own, translators)

    described = TunedLens(
        path=str(lens.path),
        made_by=lens.made_by,
        base_model=lens.base_model,
        num_layers=lens.num_layers,
    )
    return Through(wrap, described)
