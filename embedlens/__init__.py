"""embedlens: inspect the embedding table, the LM head and the logit lens of causal LMs.

Every command is a function that returns a report (`report.to_dict()` is the command's `--json`
object; `rich.print(report)` shows its tables; Jupyter shows it as HTML):

    import embedlens
    embedlens.params("SmolLM2-135M-Instruct.Q4_1.gguf")
    embedlens.lens(model, "The capital of France is", tokenizer=tokenizer)
    embedlens.lens("model.gguf", "Paris", load=embedlens.LoadOptions(dtype="bfloat16"), top_k=3)
    embedlens.lens_prompts("SmolLM2-135M-Instruct.Q4_1.gguf", ["The capital of France is"])
    embedlens.LogitLens.from_model(model)(hidden, layer)  # a caller's own tensors, decoded

Importing embedlens is cheap: torch, transformers and numpy load when a function needs them.
Each function leaves the process as it found it (`embedlens.guest`): environment variables, log
levels, progress bars, the garbage collector's and torch's settings are put back when it returns
or raises.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# cheap (no Rich): lets every report render however its function was imported
import embedlens.views  # noqa: F401

if TYPE_CHECKING:
    from embedlens.analysis.addr import addr
    from embedlens.analysis.lens import lens, lens_parity, lens_prompts, lens_states, lens_text
    from embedlens.analysis.lens.decoders import JacobianLens, LogitLens, TunedLens
    from embedlens.analysis.neighbors import neighbors
    from embedlens.analysis.params import params
    from embedlens.analysis.tied import tied
    from embedlens.analysis.tune import tune
    from embedlens.analysis.vocab import vocab
    from embedlens.errors import (
        CheckpointError,
        ConfigError,
        EmbedlensError,
        MissingDependencyError,
        NumericError,
        RemoteCodeError,
        ResourceError,
        SourceError,
        UnsupportedError,
        UsageError,
    )
    from embedlens.options import LensOptions, LoadOptions
    from embedlens.reports import Report

_EXPORTS = {
    "params": "embedlens.analysis.params",
    "tied": "embedlens.analysis.tied",
    "neighbors": "embedlens.analysis.neighbors",
    "addr": "embedlens.analysis.addr",
    "lens": "embedlens.analysis.lens",
    "lens_parity": "embedlens.analysis.lens",
    "lens_prompts": "embedlens.analysis.lens",
    "lens_states": "embedlens.analysis.lens",
    "lens_text": "embedlens.analysis.lens",
    "JacobianLens": "embedlens.analysis.lens.decoders",
    "LogitLens": "embedlens.analysis.lens.decoders",
    "TunedLens": "embedlens.analysis.lens.decoders",
    "vocab": "embedlens.analysis.vocab",
    "tune": "embedlens.analysis.tune",
    "Report": "embedlens.reports",
    "LoadOptions": "embedlens.options",
    "LensOptions": "embedlens.options",
    **{
        name: "embedlens.errors"
        for name in (
            "EmbedlensError",
            "UsageError",
            "SourceError",
            "CheckpointError",
            "ConfigError",
            "RemoteCodeError",
            "UnsupportedError",
            "MissingDependencyError",
            "ResourceError",
            "NumericError",
        )
    },
}

_FUNCTIONS = frozenset(
    {"params", "tied", "neighbors", "addr", "vocab", "tune"}
    | {"lens", "lens_parity", "lens_prompts", "lens_states", "lens_text"}
)
"""The public functions: each runs as a guest (`embedlens.guest`)."""

__all__ = [
    "CheckpointError",
    "ConfigError",
    "EmbedlensError",
    "JacobianLens",
    "LensOptions",
    "LoadOptions",
    "LogitLens",
    "MissingDependencyError",
    "NumericError",
    "RemoteCodeError",
    "Report",
    "ResourceError",
    "SourceError",
    "TunedLens",
    "UnsupportedError",
    "UsageError",
    "__version__",
    "addr",
    "lens",
    "lens_parity",
    "lens_prompts",
    "lens_states",
    "lens_text",
    "neighbors",
    "params",
    "tied",
    "tune",
    "vocab",
]


def __getattr__(name: str) -> Any:
    """Import what is asked for on first use (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'embedlens' has no attribute '{name}'")
    from embedlens import runtime

    runtime.tune_for_command(name)  # the command line's BLAS threads, before numpy loads
    value = getattr(importlib.import_module(module), name)
    if name in _FUNCTIONS:
        from embedlens.guest import as_guest

        value = as_guest(value)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
