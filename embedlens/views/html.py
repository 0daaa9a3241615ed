"""Reports as HTML for notebooks: the same tables the terminal shows, as real <table> elements.

A report's Rich rendering is walked piece by piece: a `rich.table.Table` becomes an HTML table
(title as caption, headers, right-aligned numbers, section lines), a `rich.text.Text` a paragraph
with its styles, and anything else falls back to Rich's own HTML export.
"""

from __future__ import annotations

import html
import io
from collections.abc import Iterable
from itertools import pairwise

from rich.console import Console, Group, RenderableType
from rich.style import Style
from rich.table import Table
from rich.text import Text

from embedlens.reports import Report, register_html

_COLOURS = {
    "red": "#c0392b",
    "green": "#1e8449",
    "yellow": "#9a7d0a",
    "blue": "#2e86c1",
    "magenta": "#8e44ad",
    "cyan": "#148f77",
}
_TABLE_CSS = (
    "border-collapse:collapse;margin:0.4em 0;font-variant-numeric:tabular-nums;"
    "font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:0.9em"
)
_CELL_CSS = "padding:0.15em 0.6em;border-bottom:1px solid #ddd;white-space:pre"


def report_html(report: Report) -> str:
    """A report as HTML: its tables, and for a lens with a grid its heatmap when matplotlib is
    installed."""
    from embedlens.reports.lens import LensReport

    out = to_html(report.__rich__())
    if isinstance(report, LensReport) and report.grid is not None:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is not None:
            from embedlens.views.heatmap import heatmap_svg

            out += "<div class='embedlens-heatmap'>" + heatmap_svg(report) + "</div>"
    return out


def to_html(renderable: RenderableType) -> str:
    """HTML for a Rich renderable: Groups, Tables and Texts natively, anything else exported."""
    return "<div class='embedlens-report'>" + "".join(_pieces(renderable)) + "</div>"


def _pieces(renderable: RenderableType) -> Iterable[str]:
    if isinstance(renderable, Group):
        for part in renderable.renderables:
            yield from _pieces(part)
    elif isinstance(renderable, Table):
        yield _table(renderable)
    elif isinstance(renderable, Text):
        yield f"<p style='margin:0.2em 0;white-space:pre-wrap'>{_text(renderable)}</p>"
    elif isinstance(renderable, str):
        yield f"<p style='margin:0.2em 0;white-space:pre-wrap'>{html.escape(renderable)}</p>"
    else:
        console = Console(file=io.StringIO(), record=True, width=120, color_system="truecolor")
        console.print(renderable)
        yield console.export_html(inline_styles=True, code_format="<pre>{code}</pre>")


def _style(style: Style | str) -> Style:
    """A Rich style, a theme name ('table.title') resolved through Rich's default theme."""
    if isinstance(style, Style):
        return style
    from rich.default_styles import DEFAULT_STYLES
    from rich.errors import StyleSyntaxError

    if style in DEFAULT_STYLES:
        return DEFAULT_STYLES[style]
    try:
        return Style.parse(style)
    except StyleSyntaxError:
        return Style()


def _css(style: Style | str | None) -> str:
    """Inline CSS for the few Rich styles reports use: bold, dim, italic, reverse, colours."""
    if style is None or style == "":
        return ""
    parsed = _style(style)
    rules = []
    if parsed.bold:
        rules.append("font-weight:bold")
    if parsed.dim:
        rules.append("opacity:0.65")
    if parsed.italic:
        rules.append("font-style:italic")
    if parsed.reverse:
        rules.append("background:#444;color:#fff")
    if parsed.color is not None and parsed.color.name in _COLOURS:
        rules.append("color:" + _COLOURS[parsed.color.name])
    return ";".join(rules)


def _text(text: Text | str) -> str:
    """A Text's characters escaped, its spans as styled <span>s."""
    if isinstance(text, str):
        return html.escape(text)
    out = []
    for segment_text, style in _segments(text):
        css = _css(style)
        escaped = html.escape(segment_text)
        out.append(f"<span style='{css}'>{escaped}</span>" if css else escaped)
    base = _css(text.style)
    body = "".join(out)
    return f"<span style='{base}'>{body}</span>" if base else body


def _segments(text: Text) -> Iterable[tuple[str, Style | str | None]]:
    """The text cut at span boundaries, each piece with the style of the span over it."""
    plain = text.plain
    cuts = sorted({0, len(plain), *(s.start for s in text.spans), *(s.end for s in text.spans)})
    for start, end in pairwise(cuts):
        if start >= end:
            continue
        styles = [s.style for s in text.spans if s.start <= start and s.end >= end]
        combined: Style | None = None
        for s in styles:
            parsed = _style(s)
            combined = parsed if combined is None else combined + parsed
        yield plain[start:end], combined


def _cell(value: RenderableType, justify: str, header: bool = False) -> str:
    tag = "th" if header else "td"
    align = "right" if justify == "right" else "center" if justify == "center" else "left"
    body = _text(value) if isinstance(value, (Text, str)) else "".join(_pieces(value))
    return f"<{tag} style='{_CELL_CSS};text-align:{align}'>{body}</{tag}>"


def _table(table: Table) -> str:
    parts = [f"<table style='{_TABLE_CSS}'>"]
    if table.title:
        title = table.title if isinstance(table.title, (Text, str)) else str(table.title)
        parts.append(f"<caption style='font-weight:bold;text-align:left'>{_text(title)}</caption>")
    if table.show_header and any(str(c.header) for c in table.columns):
        parts.append("<thead><tr>")
        parts += [_cell(c.header, c.justify, header=True) for c in table.columns]
        parts.append("</tr></thead>")
    parts.append("<tbody>")
    cells = [list(c.cells) for c in table.columns]
    for i, row in enumerate(table.rows):
        css = _css(row.style) if isinstance(row.style, (Style, str)) else ""
        line = "border-bottom:2px solid #888;" if row.end_section else ""
        parts.append(f"<tr style='{line}{css}'>")
        parts += [_cell(col[i], c.justify) for col, c in zip(cells, table.columns, strict=True)]
        parts.append("</tr>")
    parts.append("</tbody></table>")
    return "".join(parts)


register_html(Report, report_html)
