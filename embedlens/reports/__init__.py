"""Report dataclasses: what each command computes, and the one JSON object written from it.

These modules import nothing heavy (no torch, numpy or Rich), so the API, the renderers and tests
can use them freely. Field names are the JSON contract, written out field by field in
docs/json.md (tests/test_json_doc.py keeps the two in step): add fields freely, never rename or
remove one. How a report is shown lives in `embedlens.views`.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from rich.console import RenderableType

SCHEMA_VERSION = 1


class Report:
    """Base of every command's report (a frozen dataclass with a `model` field): its JSON object,
    and its display in a terminal (`rich.print(report)`) and in a notebook (HTML)."""

    command: ClassVar[str]
    notes: list[str]
    """What the user should know beside the figures (the command line writes them on stderr)."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON object `--json` prints: schema_version, command, model, then the fields."""
        body = _plain(self)
        out: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "command": self.command,
            "model": body["model"],
        }
        out.update((k, v) for k, v in body.items() if k not in out)
        return out

    def to_json(self, *, indent: int | None = None) -> str:
        """`to_dict()` as JSON text (non-finite numbers are null, as in `--json`); text that is not
        UTF-8 (a MODEL path's raw bytes) is escaped, so the result always encodes."""
        data = self.to_dict()
        text = json.dumps(data, ensure_ascii=False, allow_nan=False, indent=indent)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = json.dumps(data, ensure_ascii=True, allow_nan=False, indent=indent)
        return text

    def __rich__(self) -> RenderableType:
        """The tables the command line prints (`rich.print(report)`)."""
        view = importlib.import_module(f"embedlens.views.{self.command}")
        return view.render(self)  # type: ignore[no-any-return]

    def _repr_html_(self) -> str:
        """The same tables as HTML, for Jupyter."""
        from embedlens.views.html import report_html

        return report_html(self)


def _plain(value: Any) -> Any:
    """A report as JSON-native values (what dataclasses.asdict gives, non-finite floats as None),
    in one pass: a list of floats (every row's value) is converted without a call per item."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if type(value) is list and value and set(map(type, value)) == {float}:
        if math.isfinite(sum(value)):  # a NaN or an infinity would make the sum one
            return list(value)
        return [v if math.isfinite(v) else None for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"not JSON-native: {type(value).__name__}")
