"""The gate's pieces for shortcuts outside transformers (Rich, Jinja, gguf, huggingface_hub):
EMBEDLENS_PLAIN, a library's release as numbers, and the one note a public path gives."""

from __future__ import annotations

from embedlens.compat import forget_said, plain, release, say_once

__all__ = ["forget_said", "plain", "public_path", "release", "within"]


def within(distribution: str, low: tuple[int, ...], high: tuple[int, ...]) -> bool:
    """The installed release is at least `low` and below `high`."""
    got = release(distribution)
    return got is not None and low <= got < high


def public_path(message: str) -> None:
    """One `note:` line, once a process: a shortcut took its public path (`message` says which
    and why). On the command line a note on stderr (silenced by --quiet); from Python a
    `PublicPathNote` warning."""
    say_once(message)
