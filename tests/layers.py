"""embedlens' layers, lowest first, and the edges allowed between them.

What the layers are (read from the imports, not wished):

- base: errors, text, runtime, guest, the option objects and the progress protocol (`options`,
  `progress`), and compat's release and path helpers (`compat`, `compat.jinja2`, `compat.gguf`, `compat.torch`):
  what every layer may use.
- io: finding and reading files (a source resolved, checkpoint and GGUF headers, byte ranges).
- model: what a model is made of (config, tokenizer, matrices, loading) and the shortcuts over
  transformers in `compat.transformers` (they build models and tokenizers: model's work).
- reports: the report classes (plain data; they import base alone).
- analysis: the commands' work, which reads models and returns reports.
- views: how a report is shown (tables, HTML, drawings), from reports alone.
- facade: the package's own `embedlens` (a lazy look-up of every command and the version).
- cli: the command line (and `__main__`, which runs it).

An edge goes from a module to one of the same layer or of a layer below it, and only between the
layers `ALLOWED` names: a new kind of edge (views reading a model, io calling analysis) fails
tests/test_import_graph.py until it is written here on purpose.
"""

from __future__ import annotations

LAYERS: tuple[str, ...] = ("base", "io", "model", "reports", "analysis", "views", "facade", "cli")

_PREFIXES: tuple[tuple[str, str], ...] = (
    ("embedlens.__main__", "cli"),
    ("embedlens.errors", "base"),
    ("embedlens.text", "base"),
    ("embedlens.runtime", "base"),
    ("embedlens.guest", "base"),
    ("embedlens.options", "base"),
    ("embedlens.progress", "base"),
    ("embedlens.compat.transformers", "model"),
    ("embedlens.compat", "base"),
    ("embedlens.io", "io"),
    ("embedlens.model", "model"),
    ("embedlens.reports", "reports"),
    ("embedlens.analysis", "analysis"),
    ("embedlens.views", "views"),
    ("embedlens.cli", "cli"),
)

ALLOWED: dict[str, frozenset[str]] = {
    "base": frozenset({"base"}),
    "io": frozenset({"io", "base"}),
    "model": frozenset({"model", "io", "base"}),
    "reports": frozenset({"reports", "base"}),
    "analysis": frozenset({"analysis", "reports", "model", "io", "base"}),
    "views": frozenset({"views", "reports", "base"}),
    "facade": frozenset({"facade", "views", "analysis", "reports", "base"}),
    "cli": frozenset({"cli", "facade", "views", "analysis", "reports", "model", "io", "base"}),
}
"""Each layer's allowed targets (itself included)."""


def layer_name(module: str) -> str:
    """The layer of a dotted embedlens module name."""
    if module == "embedlens":
        return "facade"
    for prefix, name in _PREFIXES:
        if module == prefix or module.startswith(prefix + "."):
            return name
    raise KeyError(f"{module} is in no layer: name its layer in tests/layers.py")


def layer_of(module: str) -> int:
    """The layer's rank, lowest 0."""
    return LAYERS.index(layer_name(module))
