"""The one type for a token in every report: its id and its exact text."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenRef:
    """One token: its id and exact text (bytes that are not UTF-8 shown as \\xNN)."""

    id: int
    token: str
