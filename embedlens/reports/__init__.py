"""Report dataclasses: what each command computes, consumed by the Rich and JSON writers.

These modules import nothing heavy, so renderers and tests can use them freely. Field names are
the JSON contract (shared/CONTRACT.md): add fields freely, never rename or remove one.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Protocol

SCHEMA_VERSION = 1


class Report(Protocol):
    """Any report: a dataclass with a `command` name and the `model` as the user gave it."""

    command: ClassVar[str]
    model: str


def to_json_dict(report: Report) -> dict[str, Any]:
    """The JSON object for a report: schema_version, command, model, then its fields."""
    body = _plain(dataclasses.asdict(report))  # type: ignore[call-overload]
    out: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "command": report.command,
        "model": report.model,
    }
    out.update((k, v) for k, v in body.items() if k not in out)
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"not JSON-native: {type(value).__name__}")
