"""How large a value a chat template's operation would build, estimated before it runs.

One C call (`'x'.ljust(10**10)`, `'%*s' % (10**10, '')`, `str()` of a list that holds itself
ten thousand times over) can take gigabytes and minutes where no timer interrupts it. These
estimates let embedlens.model.chat refuse such an operation before it starts: each is an upper
bound of about the right size (never below what the operation builds), in characters (elements
for a repeated list). Each container is walked once however often it is held, so an estimate
costs no more than the values the template already holds. Nothing here imports Jinja.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping, Sized
from string import Formatter
from typing import Any, TypeGuard

_CONTAINERS = (list, tuple, set, frozenset, dict)
_OTHER = 64
"""Characters assumed for a value of another type (a number, a namespace, a macro)."""


def value_size(value: Any) -> int:
    """About how many characters `str(value)` holds: a part held in several places counted
    each time (as str() writes it), each container walked once. 0 when the value is nested
    too deeply to walk (str() then fails on its own)."""
    try:
        return _size(value, {})
    except RecursionError:
        return 0


def _size(value: Any, seen: dict[int, int]) -> int:
    if isinstance(value, str | bytes):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return digits(value)
    if not isinstance(value, _CONTAINERS):
        return _OTHER
    if id(value) in seen:
        return seen[id(value)]
    seen[id(value)] = 0  # a container that holds itself is written as [...]
    items = value.items() if isinstance(value, dict) else value
    total = 2
    for item in items:
        total += _size(item, seen) + 2
    seen[id(value)] = total
    return total


def digits(n: int) -> int:
    """Decimal digits of an integer (one more at most), without writing it out."""
    return int(abs(n).bit_length() * math.log10(2)) + 1


def repeat_size(operator: str, left: Any, right: Any) -> int | None:
    """The size of `left * right` (a repeated sequence's elements, a product's digits) or of
    `left ** right` (a power's digits); None for anything else."""
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, str | bytes | list | tuple) and _is_int(n):
                return len(seq) * max(n, 0)
        if _is_int(left) and _is_int(right):
            return digits(left) + digits(right)
        return None
    if operator == "**" and _is_int(left) and _is_int(right) and right > 0:
        return int(right * math.log10(abs(left))) + 1 if abs(left) > 1 else 1
    return None


def concat_size(left: Any, right: Any) -> int | None:
    """The size of `left + right` for two sequences; None for anything else."""
    kinds = (str, bytes, list, tuple)
    if isinstance(left, kinds) and isinstance(right, kinds):
        return len(left) + len(right)
    return None


_PRINTF = re.compile(
    r"%(?:\(([^)]*)\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?([diouxXeEfFgGcrsab%])"
)


def printf_size(fmt: str | bytes, args: Any) -> int:
    """About the size of `fmt % args`: the format, each field's width and precision, and the
    value it writes."""
    text = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
    values = list(args) if isinstance(args, tuple) else [args]
    total = len(text)
    for match in _PRINTF.finditer(text):
        key, width, precision, conversion = match.groups()
        if conversion == "%":
            continue
        total += _printf_number(width, values) + _printf_number(precision, values)
        if key is not None and isinstance(args, Mapping):
            total += value_size(args.get(key))
        elif values:
            total += value_size(values.pop(0))
    return total


def _printf_number(spec: str | None, values: list[Any]) -> int:
    """A width or precision: written out, or taken from the arguments ('*')."""
    if spec == "*":
        taken = values.pop(0) if values else 0
        return abs(taken) if _is_int(taken) else 0
    return _number(spec) if spec else 0


def format_size(fmt: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """About the size of `fmt.format(*args, **kwargs)`: the literal text, and for each field
    the value it names, its width and its precision (nested fields resolved)."""
    try:
        parsed = list(Formatter().parse(fmt))
    except ValueError:
        return len(fmt)  # format() raises its own error
    fields = _Fields(args, kwargs)
    total = 0
    for literal, name, spec, _conversion in parsed:
        total += len(literal)
        if name is None:
            continue
        value = fields.value(name)
        spec = re.sub(r"\{([^{}]*)\}", lambda m: fields.number(m.group(1)), spec or "")
        total += value_size(value) + sum(_number(n) for n in re.findall(r"\d+", spec))
    return total


class _Fields:
    """The arguments of a str.format call, looked up by field name as format() does."""

    def __init__(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        self.args, self.kwargs, self.auto = args, kwargs, 0

    def value(self, name: str) -> Any:
        base = re.match(r"[^.\[]*", name)
        key = base.group() if base else ""
        if key == "":
            index, self.auto = self.auto, self.auto + 1
            return self.args[index] if index < len(self.args) else None
        if key.isdigit():
            index = int(key)
            return self.args[index] if index < len(self.args) else None
        return self.kwargs.get(key)

    def number(self, name: str) -> str:
        """A nested field of a format spec (a width or precision), written out."""
        value = self.value(name)
        return str(value) if _is_int(value) and digits(value) < 4000 else "0"


def method_size(fn: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int | None:
    """The size of what a str (or bytes) method that can grow its string returns, or of
    int.to_bytes; None for any other call."""
    owner, name = getattr(fn, "__self__", None), getattr(fn, "__name__", "")
    if _is_int(owner) and name == "to_bytes":
        return _int_arg(args, kwargs, 0, "length", 1)
    if not isinstance(owner, str | bytes):
        return None
    n = len(owner)
    if name in ("ljust", "rjust", "center", "zfill"):
        return max(n, _int_arg(args, kwargs, 0, "width", 0))
    if name == "expandtabs":
        tabs = _occurrences(owner, "\t" if isinstance(owner, str) else b"\t")
        return n + tabs * _int_arg(args, kwargs, 0, "tabsize", 8)
    if name == "replace" and len(args) >= 2:
        count = args[2] if len(args) > 2 else kwargs.get("count", -1)
        return replace_size(owner, args[0], args[1], count)
    if name == "join" and args:
        return join_size(owner, args[0])
    if name == "translate" and args and isinstance(args[0], Mapping):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str | bytes)), default=1)
        return n * max(longest, 1)
    return None


def replace_size(s: Any, old: Any, new: Any, count: Any = None) -> int | None:
    """The size of s.replace(old, new, count)."""
    if not (isinstance(s, str | bytes) and isinstance(old, type(s)) and isinstance(new, type(s))):
        return None
    found = len(s) + 1 if not old else _occurrences(s, old)
    if _is_int(count) and count >= 0:
        found = min(found, count)
    return len(s) + found * max(len(new) - len(old), 0)


def join_size(separator: Any, items: Any) -> int | None:
    """The size of separator.join(items) (str() of each item, as Jinja's join filter writes
    it); None when the items cannot be counted without consuming them."""
    if not isinstance(items, Collection) or isinstance(items, Mapping):
        return None
    sep = len(separator) if isinstance(separator, str | bytes) else 0
    total = sep * max(len(items) - 1, 0)
    if isinstance(items, str | bytes):
        return total + len(items)
    for item in items:
        total += value_size(item)
    return total


def _occurrences(s: Any, sub: Any) -> int:
    return int(s.count(sub))


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(text: str) -> int:
    """A number written in a format, however long (Python refuses to read over 4,300 digits)."""
    return int(text) if len(text) < 4000 else 10 ** min(len(text), 4000)


def _int_arg(
    args: tuple[Any, ...], kwargs: Mapping[str, Any], index: int, name: str, default: int
) -> int:
    value = args[index] if len(args) > index else kwargs.get(name, default)
    return value if _is_int(value) else default


_PASSED = ("eval_ctx", "environment", "env", "context")
"""Parameters through which Jinja hands a filter its context rather than a value."""


def filter_size(name: str, arguments: Mapping[str, Any]) -> int | None:
    """The size of what one of Jinja's filters (or transformers' tojson) would build, from its
    arguments by parameter name; None for a filter that cannot grow a value in one call."""
    values = [v for k, v in arguments.items() if k not in _PASSED]
    if not values or name not in _FILTERS:
        return None
    return _FILTERS[name](values[0], arguments)


def _center(value: Any, a: Mapping[str, Any]) -> int:
    width = a.get("width")
    return max(value_size(value), width if _is_int(width) else 0)


def _indent(value: Any, a: Mapping[str, Any]) -> int:
    width = a.get("width")
    each = len(width) if isinstance(width, str) else width if _is_int(width) else 0
    lines = value.count("\n") + 2 if isinstance(value, str) else 2
    return value_size(value) + lines * max(each, 0)


def _format(value: Any, a: Mapping[str, Any]) -> int | None:
    if not isinstance(value, str):
        return None
    return printf_size(value, a.get("kwargs") or tuple(a.get("args") or ()))


def _tojson(value: Any, a: Mapping[str, Any]) -> int:
    indent = a.get("indent")
    width = len(indent) if isinstance(indent, str) else indent if _is_int(indent) else 0
    separators = a.get("separators")
    between = 3  # json's own ", " and ": "
    if isinstance(separators, list | tuple):
        between = sum(len(s) for s in separators if isinstance(s, str))
    return value_size(value) * (1 + between + max(width, 0))


def _join(value: Any, a: Mapping[str, Any]) -> int | None:
    if a.get("attribute") is not None:
        return None
    return join_size(a.get("d", ""), value)


def _string(value: Any, a: Mapping[str, Any]) -> int:
    return value_size(value)


def _sum(value: Any, a: Mapping[str, Any]) -> int | None:
    """sum() of sequences copies every partial sum (quadratic): their sizes added up."""
    start = a.get("start")
    if not isinstance(start, list | tuple) or a.get("attribute") is not None:
        return None
    if not isinstance(value, list | tuple):
        return None
    partial = total = len(start)
    for item in value:
        partial += len(item) if isinstance(item, Sized) else 1
        total += partial
    return total


def _batch(value: Any, a: Mapping[str, Any]) -> int | None:
    count = a.get("linecount")
    return count if _is_int(count) and a.get("fill_with") is not None else None


def _replace(value: Any, a: Mapping[str, Any]) -> int | None:
    return replace_size(value, a.get("old"), a.get("new"), a.get("count"))


def _wordwrap(value: Any, a: Mapping[str, Any]) -> int | None:
    wrap = a.get("wrapstring")
    if not isinstance(value, str) or not isinstance(wrap, str):
        return None
    return len(value) + (len(value) + 1) * max(len(wrap) - 1, 0)


_FILTERS = {
    "center": _center, "indent": _indent, "format": _format, "tojson": _tojson, "join": _join,
    "string": _string, "sum": _sum, "batch": _batch, "replace": _replace, "wordwrap": _wordwrap,
}  # fmt: skip
FILTERS_CHECKED = tuple(_FILTERS)
"""The filters whose result filter_size estimates."""
