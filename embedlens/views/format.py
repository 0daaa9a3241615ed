"""Formatting shared by every view: text from users and model files, counts, sizes, probabilities."""

from __future__ import annotations

import math

from rich.text import Text

from embedlens.text import binary_size, visible


def shown(text: str, style: str = "") -> Text:
    """Text from the user or a model file (a path, a token, a config value) as it is shown.

    A Text is never read as Rich markup (so 'my[red]model' and 'a[/]b' show as written), and
    every control character (C0, DEL, C1, so any escape sequence) is written as an escape.
    """
    return Text(visible(text), style=style)


def quoted(token: str) -> Text:
    """A token in single quotes, shown as `shown` shows text (spaces at its ends visible)."""
    return shown("'" + token + "'")


def count(n: int) -> str:
    """An integer with thousands separators."""
    return f"{n:,}"


def share(x: float) -> str:
    """A fraction as a percentage."""
    return f"{100 * x:.2f}%"


def size(n: int | None) -> str:
    """Bytes in binary units; '-' when unknown."""
    return "-" if n is None else binary_size(n)


def lens_name(report: object) -> str:
    """Which lens drew a lens report: 'Tuned lens' (`lens --tuned`) or 'Logit lens'."""
    return "Tuned lens" if getattr(report, "tuned", None) is not None else "Logit lens"


def prob(p: float, logprob: float, digits: int = 3) -> str:
    """A probability as the table shows it; a small one from its log, which never underflows
    (float32 gives 0 below about 1e-45, and a 0 would read as less likely than it is)."""
    if p >= 10**-digits:
        return f"{p:.{digits}f}"
    exponent = math.floor(logprob / math.log(10))
    mantissa = math.exp(logprob - exponent * math.log(10))
    if mantissa >= 9.95:  # rounds up to the next power of ten
        mantissa, exponent = mantissa / 10, exponent + 1
    return f"{mantissa:.1f}e{exponent:+03d}"
