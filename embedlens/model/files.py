"""A source's files read once (`ModelFiles`): its checkpoint's headers and its config, checked
with embedlens' own checks before transformers reads the model (`check_source`). The tokenizer,
the memory check and the model are built from it; nothing after goes back to the files for what
it holds.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from embedlens.io.checkpoint import Checkpoint
    from embedlens.io.source import ModelSource
    from embedlens.model.config import ModelConfig


@dataclass(frozen=True)
class ModelFiles:
    """What a source's files say, read and checked once: every tensor's header entry (None when
    the weights are neither safetensors nor GGUF) and the config (config.json, or a GGUF file's
    metadata)."""

    source: ModelSource
    checkpoint: Checkpoint | None
    config: ModelConfig

    @property
    def config_json(self) -> dict[str, Any] | None:
        """config.json as JSON (None for a GGUF file, whose config is its metadata)."""
        return None if self.source.is_gguf else self.config.raw


_READ: dict[int, dict[bool, tuple[Checkpoint | None, ModelConfig]]] = {}
"""What check_source read, by id() of the source and trust_remote_code (an entry goes with its
source, so an id used again starts unread; it holds no reference to the source)."""


def _read(source: ModelSource) -> dict[bool, tuple[Checkpoint | None, ModelConfig]]:
    """The files read of `source`, by the trust_remote_code they were checked with."""
    key = id(source)
    read = _READ.get(key)
    if read is None:
        read = _READ[key] = {}
        weakref.finalize(source, _READ.pop, key, None)
    return read


def check_source(source: ModelSource, *, trust_remote_code: bool = False) -> ModelFiles:
    """The config and every checkpoint header, read with embedlens' own checks (once per source
    and trust_remote_code) before transformers reads the model: a corrupt file, an encoder-only
    config or one that needs remote code ends in embedlens' error, not in transformers' (or in a
    crash)."""
    read = _read(source)
    kept = read.get(trust_remote_code)
    if kept is not None:
        return ModelFiles(source, *kept)
    from embedlens.io.checkpoint import open_checkpoint
    from embedlens.model.headers import (
        check_integer_weights,
        check_matches,
        check_tables,
        read_config,
    )

    ckpt = open_checkpoint(source)
    config = read_config(source, ckpt, trust_remote_code=trust_remote_code)
    if ckpt is not None:
        check_tables(ckpt, config)
        check_matches(source, config, ckpt)
        check_integer_weights(ckpt, config)
    read[trust_remote_code] = ckpt, config
    return ModelFiles(source, ckpt, config)


def files_of(given: ModelSource | ModelFiles, *, trust_remote_code: bool = False) -> ModelFiles:
    """`given` as read already, else its files read now (`check_source`)."""
    if isinstance(given, ModelFiles):
        return given
    return check_source(given, trust_remote_code=trust_remote_code)
