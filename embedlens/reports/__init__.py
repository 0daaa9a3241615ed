"""Report dataclasses: what each command computes, and the one JSON object written from it.

These modules import nothing heavy (no torch, numpy or Rich), so the API, the renderers and tests
can use them freely. Field names are the JSON contract, written out field by field in
docs/json.md (tests/test_json_doc.py keeps the two in step): add fields freely, never rename or
remove one. How a report is shown lives in `embedlens.views`, which imports these modules and
never the other way: each view registers itself here (`register_view`), and importing
`embedlens.views` (as `import embedlens` does) lets every report render.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from embedlens.reports.floats import LONG, dumps_floats

if TYPE_CHECKING:
    from rich.console import RenderableType

SHOWN_ONLY = {"json": False}
"""`field(metadata=SHOWN_ONLY)`: a field that says how a report is shown, left out of its JSON."""
PART = "part"
"""Field metadata of an optional part: when the part is in the JSON (`part`)."""
SCHEMA_VERSION = 1

R = TypeVar("R", bound="Report")
T = TypeVar("T")

_VIEWS: dict[type, Callable[[Any], RenderableType]] = {}
"""How each report type is shown in a terminal (its view's `render`)."""
_HTML: dict[type, Callable[[Any], str]] = {}
"""How each report type (or a base of it) is shown in a notebook."""
_load_views: Callable[[], None] | None = None
"""Imports the views (set by `embedlens.views`); called when a report has no view yet."""


class Report:
    """Base of every command's report (a frozen dataclass with a `model` field): its JSON object,
    and its display in a terminal (`rich.print(report)`) and in a notebook (HTML)."""

    command: ClassVar[str]
    notes: list[str]
    """What the user should know beside the figures (the command line writes them on stderr)."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON object `--json` prints: schema_version, command, model, then the fields."""
        return self._json_object(None)

    def _json_object(self, lists: dict[str, str] | None) -> dict[str, Any]:
        """`to_dict()`; given `lists`, with each long list of floats written apart (`_plain`)."""
        body = _plain(self, lists)
        out: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "command": self.command,
            "model": body["model"],
        }
        fields: dict[str, dataclasses.Field[Any]] = getattr(self, "__dataclass_fields__", {})
        left_out = {name for name, f in fields.items() if not _written(self, f)}
        out.update((k, v) for k, v in body.items() if k not in out and k not in left_out)
        return out

    def to_json(self, *, indent: int | None = None) -> str:
        """`to_dict()` as JSON text (non-finite numbers are null, as in `--json`); text that is not
        UTF-8 (a MODEL path's raw bytes) is escaped, so the result always encodes."""
        lists: dict[str, str] | None = {} if indent is None else None
        text = _dumps(self._json_object(lists), indent)
        if lists:  # the long lists of floats written apart, in their marks' places
            spliced = _spliced(text, lists)
            text = spliced if spliced is not None else _dumps(self.to_dict(), indent)
        return text

    def __rich__(self) -> RenderableType:
        """The tables the command line prints (`rich.print(report)`)."""
        return _registered(_VIEWS, type(self))(self)

    def _repr_html_(self) -> str:
        """The same tables as HTML, for Jupyter."""
        return _registered(_HTML, type(self))(self)


def part(written: Callable[[Any], bool] | None = None) -> dict[str, Any]:
    """`field(default=None, metadata=part())`: an optional part of a report, in its JSON only when
    it is set (not None); given `written`, only when `written(report)` holds (a part that comes
    with another, written as null when that one is set without it)."""
    return {PART: written}


def _written(report: Any, f: dataclasses.Field[Any]) -> bool:
    """Whether the field is in the report's JSON (not SHOWN_ONLY; an optional part when set)."""
    if not f.metadata.get("json", True):
        return False
    if PART not in f.metadata:
        return True
    written = f.metadata[PART]
    return getattr(report, f.name) is not None if written is None else bool(written(report))


def register_view(kind: type[R], render: Callable[[R], RenderableType]) -> None:
    """Show reports of type `kind` with `render` (each view module registers its own when it is
    imported)."""
    _VIEWS[kind] = render


def register_html(kind: type[R], to_html: Callable[[R], str]) -> None:
    """Show reports of type `kind` (and its subclasses) in a notebook with `to_html`."""
    _HTML[kind] = to_html


def set_view_loader(load: Callable[[], None]) -> None:
    """Call `load` to import the views when a report is shown before its view was registered."""
    global _load_views
    _load_views = load


def _registered(table: dict[type, Callable[[Any], T]], kind: type) -> Callable[[Any], T]:
    """What table holds for kind or its nearest base, the views imported first when it holds
    nothing yet; LookupError when no view was registered for it."""
    for attempt in range(2):
        for base in kind.__mro__:
            if base in table:
                return table[base]
        if attempt == 0 and _load_views is not None:
            _load_views()
    raise LookupError(
        f"no view shows a {kind.__name__}: import embedlens.views (or the module of its view)"
    )


def _plain(value: Any, lists: dict[str, str] | None = None) -> Any:
    """A report as JSON-native values (what dataclasses.asdict gives, non-finite floats as None),
    in one pass: a list of floats (every row's value) is converted without a call per item, and
    given `lists`, a long one is written apart (`_apart`)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _plain(getattr(value, f.name), lists)
            for f in dataclasses.fields(value)
            if PART not in f.metadata or _written(value, f)  # an optional part, when set
        }
    if type(value) is list and value and set(map(type, value)) == {float}:
        if math.isfinite(sum(value)):  # a NaN or an infinity would make the sum one
            return list(value) if lists is None or len(value) < LONG else _apart(value, lists)
        return [v if math.isfinite(v) else None for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v, lists) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, lists) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"not JSON-native: {type(value).__name__}")


_MARK = "\0embedlens-floats-{}\0"
"""Stands in a report's JSON for a long list of floats written apart (`floats.dumps_floats`)."""


def _apart(values: list[float], lists: dict[str, str]) -> Any:
    """A mark in place of a long list of finite floats whose JSON text `floats.dumps_floats`
    writes (kept in `lists` under the mark's own JSON text); else the list itself."""
    text = dumps_floats(values, checked=True)
    if text is None:
        return list(values)
    mark = _MARK.format(len(lists))
    lists[json.dumps(mark)] = text
    return mark


def _spliced(text: str, lists: dict[str, str]) -> str | None:
    """The JSON text with each mark replaced by its list's text; None when a mark is not found
    exactly once (a string of the report that reads as a mark)."""
    if any(text.count(mark) != 1 for mark in lists):
        return None
    for mark, listed in lists.items():
        text = text.replace(mark, listed, 1)
    return text


def _dumps(data: Any, indent: int | None) -> str:
    """JSON text (non-finite numbers are null); text that is not UTF-8 escaped."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, indent=indent)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(data, ensure_ascii=True, allow_nan=False, indent=indent)
    return text
