"""Formatting shared by every view: text from users and model files, counts, sizes, probabilities."""

from __future__ import annotations

import math
import re
from itertools import pairwise
from typing import TYPE_CHECKING, Any

from rich.cells import cell_len
from rich.containers import Lines
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from embedlens.text import binary_size, visible

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, JustifyMethod, OverflowMethod

_UNLIMITED = 1 << 20


def shown(text: str, style: str = "") -> Words:
    """Text from the user or a model file (a path, a token, a config value) as it is shown.

    A Text is never read as Rich markup (so 'my[red]model' and 'a[/]b' show as written), and
    every control character (C0, DEL, C1, so any escape sequence) is written as an escape. It
    wraps at spaces only: a path or a fingerprint longer than the line stays whole (Words).
    """
    return Words(text, style=style)


def quoted(token: str, style: str = "") -> Words:
    """A token in single quotes, shown as `shown` shows text (spaces at its ends visible), and
    kept whole: no line break ever falls inside it."""
    return Words(style=style).token(token)


_WORD = re.compile(r"[^ \n]+")


class Words(Text):
    """Text that wraps only at the spaces between its words, never inside a kept span (a
    token in its quotes): a token such as ' king' never loses its leading space to a line
    break. A word or span wider than the line stands alone on its line, whole, past the width
    (printed so: nothing cuts it, nothing folds it)."""

    def __init__(self, text: str = "", style: str = "") -> None:
        super().__init__(visible(text), style=style)
        self.kept: list[tuple[int, int]] = []

    def add(self, text: str | Text, style: str = "") -> Words:
        """Append text that may wrap at its spaces (control characters escaped); the spans a
        Words keeps stay kept."""
        start = len(self.plain)
        if isinstance(text, Text):
            self.append_text(text)
            if style:
                self.stylize(style, start)
        else:
            self.append_text(Text(visible(text), style=style))
        if isinstance(text, Words):
            self.kept += [(start + a, start + b) for a, b in text.kept]
        return self

    def keep(self, text: str | Text, style: str = "") -> Words:
        """Append text no line break ever falls inside: a token, a figure with its unit."""
        start = len(self.plain)
        self.add(text, style)
        self.kept.append((start, len(self.plain)))
        return self

    def token(self, token: str, style: str = "") -> Words:
        """Append a token in quotes, kept whole."""
        return self.keep("'" + token + "'", style)

    def units(self) -> list[tuple[int, int]]:
        """(start, end) of each run of characters that no line break falls inside: the words
        between spaces, joined through the kept spans they touch."""
        plain = self.plain
        words = [(m.start(), m.end()) for m in _WORD.finditer(plain)]
        if not self.kept:
            return words
        out: list[tuple[int, int]] = []
        for start, end in sorted(words + [k for k in self.kept if k[1] > k[0]]):
            if out and start <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], end))
            else:
                out.append((start, end))
        return out

    def wrap(
        self,
        console: Console,
        width: int,
        *,
        justify: JustifyMethod | None = None,
        overflow: OverflowMethod | None = None,
        tab_size: int = 8,
        no_wrap: bool | None = None,
    ) -> Lines:
        """The lines at `width`, broken only between units (a unit too wide stays whole)."""
        plain = self.plain
        units = self.units()
        cuts: list[int] = []
        used = 0
        if units:
            used = cell_len(plain[: units[0][1]])  # leading spaces stay on the first line
            for (_, end), (start, stop) in pairwise(units):
                step = cell_len(plain[end:stop])
                if "\n" not in plain[end:start] and (no_wrap or used + step <= width):
                    used += step
                else:
                    cuts.append(start)
                    used = cell_len(plain[start:stop])
        lines = Lines(line for line in self.divide(cuts))
        for line in lines:
            line.rstrip()
        if justify:
            lines.justify(console, width, justify=justify, overflow="ignore")
        return lines

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        widest = max((cell_len(self.plain[a:b]) for a, b in self.units()), default=0)
        return Measurement(widest, max(cell_len(line) for line in self.plain.split("\n")))


class Sheet(Table):
    """A table that never cuts or folds a figure or a token: a column is at least as wide as
    its widest cell when it does not wrap (figures, tokens), and as its widest word or kept span
    (Words) when it does. A table that cannot fit the width is laid out wider than it, and its
    lines are printed whole (the command line prints with crop=False)."""

    def _hold(self, console: Console, options: ConsoleOptions) -> None:
        wide = options.update_width(_UNLIMITED)
        for column in self.columns:
            need = 0
            for cell in (column.header, *column.cells):
                span = Measurement.get(console, wide, cell)
                need = max(need, span.maximum if column.no_wrap else span.minimum)
            column.min_width = max(column.min_width or 0, need)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Any:
        self._hold(console, options)
        need = super().__rich_measure__(console, options.update_width(_UNLIMITED)).minimum
        if need > options.max_width:  # it cannot fit: it grows, rather than cut anything
            options = options.update_width(need)
        yield from super().__rich_console__(console, options)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        self._hold(console, options)
        return super().__rich_measure__(console, options)


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
    """Which lens drew a lens report: 'Tuned lens' (`lens --tuned`), 'Jacobian lens' (`lens
    --jacobian`) or 'Logit lens'."""
    kind = getattr(report, "lens", None)  # the text report names it
    if getattr(report, "tuned", None) is not None or kind == "tuned":
        return "Tuned lens"
    if getattr(report, "jacobian", None) is not None or kind == "jacobian":
        return "Jacobian lens"
    return "Logit lens"


def learned_note(report: Any, both: bool = False) -> str | None:
    """The line saying which learned lens read the layers of a lens report (`both`: the two
    models of --against); None for the logit lens."""
    n, tuned, jacobian = report.num_layers, report.tuned, getattr(report, "jacobian", None)
    if tuned is not None and both:
        return (
            f"Both models read through the tuned lens in '{tuned.path}' (its translator at "
            f"layers 0-{n - 1}), then each model's own decoder."
        )
    if tuned is not None:
        return (
            f"Layers 0-{n - 1} are read through the tuned lens in '{tuned.path}' "
            f"(made by {tuned.made_by}): its translator, then the same decode; layer "
            f"{n} is the model's own output."
        )
    if jacobian is None:
        return None
    at = spans(jacobian.layers)
    who = "Both models read" if both else f"Layers {at} are read"
    return (
        f"{who} through the Jacobian lens in '{jacobian.path}' (made by {jacobian.made_by}, "
        f"fitted on {jacobian.n_prompts:,} prompts{'' if not both else f'; matrices at {at}'}): "
        f"J_l h, then {'each model' if both else 'the model'}'s own decode; the other layers "
        "are read as the logit lens reads them."
    )


def spans(layers: list[int]) -> str:
    """Layers as runs: [1, 2, 3, 7] is '1-3, 7'."""
    runs: list[list[int]] = []
    for x in sorted(layers):
        if runs and x == runs[-1][-1] + 1:
            runs[-1].append(x)
        else:
            runs.append([x])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


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
