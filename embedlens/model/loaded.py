"""A model the caller has already loaded: recognised, named and read, never moved or changed.

A hub id or a path is told apart without importing torch or transformers; only something else is
checked against transformers' `PreTrainedModel`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, TypeGuard

from embedlens.errors import UnsupportedError, UsageError
from embedlens.model.files import ModelConfig, from_dict

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ModelSpec = str | os.PathLike[str]
"""A hub id, a folder or a .gguf file."""


def is_spec(model: object) -> TypeGuard[ModelSpec]:
    """Whether `model` names a model to read (a str or a path) rather than being one."""
    return isinstance(model, (str, os.PathLike))


def spec_text(model: ModelSpec) -> str:
    """The model's name or path as text."""
    return os.fsdecode(model)


def check_loaded(model: object, **given: bool) -> PreTrainedModel:
    """`model` as a loaded transformers causal LM, or UsageError; `given` names the options the
    caller set that only apply to a model embedlens reads itself (refused with a loaded model)."""
    if not _is_pretrained(model):
        raise UsageError(
            f"model must be a hub id, a path or a loaded transformers model, "
            f"not {type(model).__name__}"
        )
    asked = [name for name, value in given.items() if value]
    if asked:
        verb = "applies" if len(asked) == 1 else "apply"
        raise UsageError(
            f"{', '.join(asked)} {verb} only when embedlens loads the model: a model already "
            "loaded is used as it is, in its own dtype and on its own devices",
            hint="leave them out, or pass the model's hub id or path instead",
        )
    if model.get_input_embeddings() is None or model.get_output_embeddings() is None:
        raise UnsupportedError(
            f"{type(model).__name__} has no LM head (get_output_embeddings() is None)",
            hint="pass the causal LM (e.g. AutoModelForCausalLM), not its base model",
        )
    return model


def _is_pretrained(model: object) -> TypeGuard[PreTrainedModel]:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(model, PreTrainedModel)


def loaded_name(model: PreTrainedModel) -> str:
    """What a report calls a loaded model: its name_or_path when set, else its class name."""
    name = getattr(model, "name_or_path", None)
    return str(name) if name else type(model).__name__


def loaded_config(model: PreTrainedModel) -> ModelConfig:
    """The loaded model's config, read as embedlens reads config.json."""
    raw: dict[str, Any] = model.config.to_dict()
    return from_dict(raw)


def on_meta(model: PreTrainedModel) -> bool:
    """Whether the model was built on the meta device (no weights to compare by data_ptr())."""
    return bool(model.get_input_embeddings().weight.is_meta)
