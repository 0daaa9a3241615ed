"""The logit-lens picture: a layer x position heatmap of top-1 probabilities, tokens in the cells.

matplotlib is an optional extra (`pip install 'embedlens[plot]'`), imported only in functions.
Tokens are quoted as the tables quote them; a cell holds the top-1 token and, when it fits, its
probability. PNG is drawn with DejaVu Sans and, for the glyphs it lacks, installed fonts that
have them (CJK first); characters no font has are said in a note. SVG and HTML keep the tokens
as text (the viewer's fonts draw every script) and fetch nothing from elsewhere. The work is
bounded, so any grid draws in seconds (`Plan`): past TEXT_CELLS cells or TEXT_POSITIONS
positions the cells are colours only and every n-th position is labelled; past MAX_COLUMNS
positions, consecutive positions share a column (their mean). The figure and a note say so.
"""

from __future__ import annotations

import functools
import html
import importlib.util
import io
import unicodedata
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from embedlens.errors import EmbedlensError, MissingDependencyError, UsageError
from embedlens.reports.lens import GridCell, GridRow, LensReport, SiteGridRow, TargetAt
from embedlens.text import visible
from embedlens.views.format import lens_name, prob
from embedlens.views.lens import layer_label, row_label

_PREFERRED_FONTS = (
    "Noto Sans CJK SC",
    "Noto Sans CJK JP",
    "Source Han Sans SC",
    "Source Han Sans",
    "WenQuanYi Zen Hei",
    "WenQuanYi Micro Hei",
    "Droid Sans Fallback",
    "Microsoft YaHei",
    "PingFang SC",
    "Hiragino Sans GB",
    "SimHei",
    "Arial Unicode MS",
    "Noto Sans",
)
"""Fonts tried first for glyphs DejaVu Sans lacks (then any other installed font that has them)."""
BASE_FONT = "DejaVu Sans"
CELL_FONT = 7.0
"""Points: the cells' text; smaller (down to MIN_FONT) when the columns are narrow."""
MIN_FONT = 4.5
TICK_LABEL = 16
"""The most characters (a wide one counts twice) of a token under a column, quotes excluded."""
PLOT_SUFFIXES = (".png", ".svg", ".html")
TEXT_CELLS = 2_000
"""The most cells drawn with their token and probability (a text each: the drawing's cost)."""
TEXT_POSITIONS = 100
"""The most positions drawn with text: past it a column holds fewer than 6 characters of a token
in the smallest font."""
MAX_COLUMNS = 2_000
"""The most columns drawn: past it, consecutive positions share a column (2 px or more each)."""
MAX_TICKS = 100
"""The most labelled columns: past it, every n-th (2, 5, 10, 20, 50, ...) is labelled."""


def check_plot_file(path: Path) -> None:
    """Before any work: the file names a format the heatmap is drawn in, and matplotlib is there
    (else the install hint)."""
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(f"--plot '{path}': unknown format", hint="name a .png, .svg or .html file")
    if importlib.util.find_spec("matplotlib") is None:
        raise MissingDependencyError(
            "--plot needs matplotlib", hint="pip install 'embedlens[plot]'"
        )


def pyplot() -> Any:
    """matplotlib's pyplot, drawing off screen."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _width(text: str) -> int:
    """Columns the text takes: a wide (CJK, fullwidth) character counts twice."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def label(token: str, limit: int) -> str:
    """A token quoted as the tables quote it, its middle ellipsised past `limit` columns (its
    start and end stay: a leading or trailing space is still seen)."""
    text = visible(token)
    if _width(text) <= limit:
        return "'" + text + "'"
    keep = max(limit - 1, 2)
    head, tail = "", ""
    while _width(head) + _width(tail) < keep:
        if _width(head) <= 2 * _width(tail):
            head += text[len(head)]
        else:
            tail = text[len(text) - len(tail) - 1] + tail
    return "'" + head + "…" + tail + "'"


@dataclass(frozen=True)
class Fonts:
    """The font families to draw with, and the characters no installed font has."""

    families: list[str]
    missing: list[str]


def fonts_for(texts: Iterable[str]) -> Fonts:
    """DejaVu Sans, then installed fonts holding the glyphs it lacks (CJK fonts first), chosen by
    the characters in `texts`; what none holds is `missing`."""
    from matplotlib import font_manager

    chars = {c for text in texts for c in text if c.isprintable() and not c.isspace()}
    lacking = {c for c in chars if ord(c) not in _charmap(font_manager.findfont(BASE_FONT))}
    families = [BASE_FONT]
    if lacking:
        by_name: dict[str, str] = {}
        for entry in font_manager.fontManager.ttflist:
            by_name.setdefault(entry.name, entry.fname)
        order = [n for n in _PREFERRED_FONTS if n in by_name]
        order += sorted(n for n in by_name if n not in order and n != BASE_FONT)
        # matplotlib's Last Resort font "has" every character, as a box: it covers nothing
        order = [n for n in order if not n.startswith("Last Resort")]
        for name in order:
            found = {c for c in lacking if ord(c) in _charmap(by_name[name])}
            if found:
                families.append(name)
                lacking -= found
            if not lacking:
                break
    return Fonts(families, sorted(lacking))


@functools.cache
def _charmap(path: str) -> frozenset[int]:
    """The characters a font file has glyphs for (none when it cannot be read)."""
    from matplotlib import ft2font

    try:
        return frozenset(ft2font.FT2Font(path).get_charmap())
    except (OSError, RuntimeError, ValueError):
        return frozenset()


@dataclass(frozen=True)
class _Layout:
    """Sizes of the picture: inches per column and row, the cells' font, what fits in a cell."""

    column: float
    row: float
    font: float
    limit: int
    """Columns of a token's text a cell shows (quotes excluded)."""
    probs: bool
    """Whether the probability fits under the token."""


def _layout(n_positions: int, n_rows: int) -> _Layout:
    column = min(1.0, 36.0 / max(n_positions, 1))
    row = min(0.36, 56.0 / max(n_rows, 1))
    font = max(MIN_FONT, min(CELL_FONT, column * 72 * 0.9 / 9.0))
    limit = max(3, int(column * 72 * 0.9 / (0.62 * font)) - 2)
    return _Layout(column, row, font, limit, probs=row * 72 >= 2.4 * font)


@dataclass(frozen=True)
class Plan:
    """How much of the grid the picture draws: every cell's text, or colours only; a column per
    position, or per `group` consecutive positions; every column labelled, or every `step`-th."""

    positions: int
    layers: int
    text: bool
    group: int = 1
    step: int = 1

    @property
    def columns(self) -> int:
        return -(-self.positions // self.group)

    @property
    def whole(self) -> bool:
        """Whether the grid is drawn as every small one is: each cell's text, each column
        labelled."""
        return self.text and self.group == 1 and self.step == 1

    def shown(self, column: int) -> range:
        """The positions (indices into the grid's cells) that a column shows."""
        start = column * self.group
        return range(start, min(start + self.group, self.positions))

    def labelled(self) -> range:
        """The columns labelled under the grid."""
        return range(0, self.columns, self.step)

    def notes(self) -> list[str]:
        """What the picture leaves out or merges, in words (nothing for a grid drawn whole)."""
        if self.whole:
            return []
        size = f"{self.positions:,} positions x {self.layers:,} layers"
        parts = [
            f"the heatmap of {size} ({self.positions * self.layers:,} cells) is drawn without "
            f"tokens and probabilities in its cells (they are drawn up to {TEXT_CELLS:,} cells "
            f"and {TEXT_POSITIONS:,} positions; --json gives every cell)"
        ]
        if self.group > 1:
            parts.append(
                f"its positions are merged {self.group} to a column ({self.columns:,} columns, "
                "each the mean top-1 probability of its positions)"
            )
        if self.step > 1:
            which = "column" if self.group > 1 else "position"
            parts.append(f"every {_ordinal(self.step)} {which} is labelled")
        return ["; ".join(parts)]


def plan(report: LensReport) -> Plan:
    """How much of the report's grid its heatmap draws (see the module's bounds)."""
    grid = report.grid or []
    n = len(grid[0].cells) if grid else 0
    text = n * len(grid) <= TEXT_CELLS and n <= TEXT_POSITIONS
    group = max(1, -(-n // MAX_COLUMNS))
    columns = -(-n // group)
    step = 1
    while -(-columns // step) > MAX_TICKS:  # never with text: its columns are fewer
        step = _next_step(step)
    return Plan(n, len(grid), text, group, step)


def _next_step(step: int) -> int:
    """1, 2, 5, 10, 20, 50, 100, ..."""
    return step * 5 // 2 if str(step).startswith("2") else step * 2


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def texts(report: LensReport) -> list[str]:
    """Every text the heatmap draws from the model or the user (for choosing fonts)."""
    grid = report.grid or []
    drawn = plan(report)
    if drawn.whole:
        out = [c.token for row in grid for c in row.cells] + [t.token for t in report.tokens]
    else:  # the labelled columns' tokens, and the one read (the target column's heading)
        positions = [c.position for c in grid[0].cells] if grid else []
        out = [_tick(report, positions, drawn, c) for c in drawn.labelled()]
        out.append(report.tokens[report.position_index].token)
    out.append(report.display_model)
    if report.target is not None:
        out.append(report.target.token)
    return out


def figure(report: LensReport) -> Any:
    """The heatmap as a matplotlib Figure (the grid's last layer at the top), with a column of
    the target's probability beside it when the report follows one."""
    plt = pyplot()
    if report.grid is None:
        raise EmbedlensError("there is no layer x position grid to draw")
    rows = list(reversed(report.grid))
    drawn = plan(report)
    layout = _layout(drawn.columns, len(rows))
    targets = _target_column(report, [_key(row) for row in rows])
    width = 2.2 + layout.column * drawn.columns + (1.1 if targets else 0.0)
    height = 2.0 + layout.row * len(rows)
    ratios = [drawn.columns * layout.column] + ([0.9] if targets else [])
    fig, axes = plt.subplots(
        1, len(ratios), figsize=(width, height), width_ratios=ratios, layout="constrained"
    )
    ax = axes[0] if targets else axes
    image = _draw_grid(ax, report, rows, layout, drawn)
    if targets:
        _draw_target(axes[1], report, targets, layout)
    fig.suptitle(
        f"{lens_name(report)}: {report.display_model} ({report.dtype}): top-1 at every layer "
        "and position",
        fontsize=10,
    ).set_parse_math(False)
    fig.colorbar(image, ax=axes, fraction=0.03, pad=0.02, label="probability")
    return fig


def _draw_grid(
    ax: Any, report: LensReport, rows: list[GridRow], layout: _Layout, drawn: Plan
) -> Any:
    import numpy as np

    probs = np.array([[c.prob for c in row.cells] for row in rows])
    if drawn.group > 1:  # each column: the mean of its positions
        starts = list(range(0, drawn.positions, drawn.group))
        sizes = np.array([len(drawn.shown(c)) for c in range(drawn.columns)])
        probs = np.add.reduceat(probs, starts, axis=1) / sizes

    def text(c: GridCell) -> str:
        under = "\n" + prob(c.prob, c.logprob, 2) if layout.probs else ""
        return label(c.token, layout.limit) + under

    texts = [[text(c) for c in row.cells] for row in rows] if drawn.text else []
    image = _paint(ax, probs, texts, layout)
    positions = [c.position for c in rows[0].cells]
    ax.set_xticks(drawn.labelled())
    ax.set_xticklabels(
        [_tick(report, positions, drawn, c) for c in drawn.labelled()],
        rotation=60,
        ha="right",
        rotation_mode="anchor",
        fontsize=8,
        parse_math=False,
    )
    ax.set_yticks(range(len(rows)))
    n = report.num_layers
    labels = [
        row_label(row, n) if isinstance(row, SiteGridRow) else layer_label(row.layer, n)
        for row in rows
    ]
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel(_x_title(drawn))
    ax.set_ylabel("layer")
    return image


def _tick(report: LensReport, positions: list[int], drawn: Plan, column: int) -> str:
    """A column's label: its token (after its position when not every column is labelled), or
    the positions it merges."""
    shown = [positions[i] for i in drawn.shown(column)]
    if drawn.group > 1:
        return f"{shown[0]}–{shown[-1]}"
    token = label(report.tokens[shown[0]].token, TICK_LABEL)
    return token if drawn.step == 1 else f"{shown[0]} {token}"


def _x_title(drawn: Plan) -> str:
    if drawn.whole:
        return "input token (a cell: the prediction for the next one, and its probability)"
    colour = "a cell's colour: the probability of the top-1 prediction for the next token"
    if drawn.group > 1:
        colour = f"a column: {drawn.group} positions, the mean of their top-1 probabilities"
    which = "" if drawn.step == 1 else f", every {_ordinal(drawn.step)} labelled"
    return (
        f"input {'positions' if drawn.group > 1 else 'token'}{which} ({colour}; tokens are not "
        f"drawn in the cells past {TEXT_CELLS:,} cells or {TEXT_POSITIONS:,} positions)"
    )


_CELL_TEXT = {"ha": "center", "va": "center", "linespacing": 1.1, "parse_math": False}
"""How a cell's text is drawn (its size and colour aside)."""


def _paint(ax: Any, probs: Any, texts: list[list[str]], layout: _Layout) -> Any:
    """The probabilities as colours (0 white, 1 blue), each cell's text (if any) over its
    colour, in the colour that reads on it."""
    image = ax.imshow(probs, cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto")
    for y, row in enumerate(texts):
        for x, text in enumerate(row):
            color = "white" if probs[y][x] > 0.55 else "black"
            ax.text(x, y, text, fontsize=layout.font, color=color, **_CELL_TEXT)
    return image


def _key(row: Any) -> tuple[int, str]:
    """A row's layer and site (`lens --site` has a row per site of a layer)."""
    return row.layer, getattr(row, "site", "resid")


def _target_column(report: LensReport, layers: list[tuple[int, str]]) -> list[TargetAt] | None:
    """The target's probability and rank at each row's layer (top row first), if followed."""
    if report.target is None:
        return None
    at = {_key(row): row.target for row in report.layers}
    column = [at.get(layer) for layer in layers]
    return None if any(t is None for t in column) else [t for t in column if t is not None]


def _draw_target(ax: Any, report: LensReport, column: list[TargetAt], layout: _Layout) -> None:
    """One column: the target's probability at each layer, at the position read, and its rank."""
    import numpy as np

    assert report.target is not None
    texts = [
        [prob(t.prob, t.logprob, 2) + ("\n#" + str(t.rank) if layout.probs else "")] for t in column
    ]
    _paint(ax, np.array([[t.prob] for t in column]), texts, replace(layout, font=CELL_FONT))
    ax.set_yticks(range(len(column)))
    ax.set_yticklabels([])
    ax.set_xticks([0])
    ax.set_xticklabels([label(report.target.token, TICK_LABEL)], fontsize=8, parse_math=False)
    read = label(report.tokens[report.position_index].token, TICK_LABEL)
    ax.set_title(f"target\n(after {read})\np, #rank", fontsize=7).set_parse_math(False)


_NO_METADATA: dict[str, str | None] = {"Date": None, "Creator": None, "Type": None, "Format": None}


def drawn(make: Callable[[], Any], fmt: str, fonts: Fonts | None = None, **save: Any) -> bytes:
    """The bytes of the matplotlib figure `make()` draws, in `fmt` (`save`: savefig's other
    arguments), drawn with `fonts` (else matplotlib's) and SVG text kept as text; the figure is
    closed after."""
    import matplotlib
    import matplotlib.pyplot as plt

    families = matplotlib.rcParams["font.family"] if fonts is None else fonts.families
    with matplotlib.rc_context({"font.family": families, "svg.fonttype": "none"}):
        fig = make()
        try:
            buffer = io.BytesIO()
            fig.savefig(buffer, format=fmt, **save)
            return buffer.getvalue()
        finally:
            plt.close(fig)


def _heatmap(report: LensReport, fonts: Fonts, fmt: str, **save: Any) -> bytes:
    """The heatmap's bytes, drawn with fonts that cover the tokens."""
    with warnings.catch_warnings():
        # characters no font has are said once, in a note, not once per glyph
        warnings.filterwarnings("ignore", message="Glyph .* missing from font")
        return drawn(lambda: figure(report), fmt, fonts, **save)


def heatmap_svg(report: LensReport) -> str:
    """The heatmap as an inline <svg> element (for HTML pages and notebooks): tokens as text,
    nothing fetched from elsewhere."""
    fonts = fonts_for(texts(report))
    svg = _heatmap(report, fonts, "svg", metadata=_NO_METADATA).decode("utf-8")
    return svg[svg.index("<svg") :]


def save_heatmap(report: LensReport, path: Path) -> list[str]:
    """Write the heatmap to `path`: .png, .svg, or .html (the SVG inside a page, self-contained).

    Returns notes: what a large grid's picture leaves out or merges (`Plan`), and in a PNG the
    characters no installed font has (drawn as boxes)."""
    suffix = path.suffix.lower()
    bounds = plan(report).notes()
    if suffix == ".html":
        title = f"{lens_name(report)}: {report.display_model}"
        write_page(path, title, _page(report, heatmap_svg(report)))
        return bounds
    fonts = fonts_for(texts(report))
    metadata = _NO_METADATA if suffix == ".svg" else None
    write_plot(path, _heatmap(report, fonts, suffix.lstrip("."), dpi=150, metadata=metadata))
    return bounds + (_missing_note(fonts.missing) if suffix == ".png" else [])


def _missing_note(missing: list[str]) -> list[str]:
    """The note for characters no installed font has."""
    if not missing:
        return []
    shown = " ".join(missing[:12]) + (f" and {len(missing) - 12} more" if len(missing) > 12 else "")
    return [
        f"no installed font has glyphs for {shown}: the PNG draws them as empty boxes (install "
        "a CJK font such as Noto Sans CJK, or write .svg or .html, where the viewer draws the text)"
    ]


def write_plot(path: Path, data: bytes) -> None:
    """Write a drawing's bytes to path; EmbedlensError naming the path when that fails."""
    try:
        path.write_bytes(data)
    except OSError as e:
        raise EmbedlensError(f"cannot write the plot to '{path}': {e.strerror or e}") from e


def write_page(path: Path, title: str, body: str) -> None:
    """Write a self-contained HTML page: `title` (escaped here) as its title and heading, then
    `body`."""
    title = html.escape(title)
    page = (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>{title}</title></head>\n<body style='font-family: sans-serif'>\n"
        f"<h1 style='font-size: 1.2em'>{title}</h1>\n{body}\n</body></html>\n"
    )
    write_plot(path, page.encode("utf-8"))


def _page(report: LensReport, svg: str) -> str:
    """The heatmap page's body: the prompt, the picture and the self-check."""
    check = report.check
    verdict = "reproduces" if check.ok else "does NOT reproduce"
    return (
        f"<p>Prompt: <code>{html.escape(report.prompt)}</code></p>\n{svg}\n<p>Self-check: "
        f"decoding the last block's output {verdict} the model's logits (max |Δ| = "
        f"{check.max_abs_logit_diff:.2g}). Decode: {html.escape(' → '.join(report.steps))}.</p>"
    )
