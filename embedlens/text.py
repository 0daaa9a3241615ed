"""Small text helpers every layer shares: shown text, one-line messages, sizes, env flags."""

from __future__ import annotations

import os

# Control characters (C0, DEL and C1) as escapes: text from a user or a model file must never reach
# a terminal as an escape sequence (ESC, CSI U+009B), a bell or a carriage return.
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_CONTROL.update({ord("\n"): "\\n", ord("\t"): "\\t", ord("\r"): "\\r"})

_TRUE = {"1", "true", "yes", "on"}


def visible(text: str) -> str:
    """The text with every control character (C0, DEL, C1) written as an escape: '\\x1b'."""
    return text.translate(_CONTROL)


LOADED = "a loaded model"


def model_title(model: str) -> str:
    """A model as titles name it: a hub id (or a class name) whole, a local file by its name, a
    model folder (config.json) by its last part, a folder holding one .gguf file by that file's
    name; any other folder (the one a loaded model's GGUF file sat in, which transformers keeps
    as its `_name_or_path`) names no model: LOADED. Empty: LOADED."""
    from pathlib import Path

    if not model:
        return LOADED
    path = Path(model)
    try:
        if not path.is_dir():
            return path.name if path.is_file() else model
        if (path / "config.json").is_file():
            return path.name or model
        ggufs = [p for p in path.glob("*.gguf") if p.is_file()]
    except OSError:
        return model
    return ggufs[0].name if len(ggufs) == 1 else LOADED


def one_line(text: str) -> str:
    """Whitespace runs as one space (a message may quote a multi-line value)."""
    return " ".join(text.split())


def first_line(text: str, *, limit: int | None = None) -> str:
    """A message's first line ('' when empty), with the next one when the first only announces
    it (ends with ':'); cut to `limit` characters when given."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    line = " ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    if limit is not None and len(line) > limit:
        line = line[: limit - 3] + "..."
    return line


def error_line(e: BaseException, *, limit: int | None = 200) -> str:
    """An exception as one line: its message's first line, or its type's name."""
    return first_line(str(e), limit=limit) or type(e).__name__


def binary_size(n: int) -> str:
    """Bytes in binary units, e.g. '1.50 GiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def env_flag(name: str) -> bool:
    """Whether an environment variable is set to a true value (1, true, yes, on)."""
    return os.environ.get(name, "").strip().lower() in _TRUE


def debug_enabled() -> bool:
    """Whether tracebacks and library warnings were asked for (--debug or EMBEDLENS_DEBUG=1)."""
    return env_flag("EMBEDLENS_DEBUG")
