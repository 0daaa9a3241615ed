"""How the `neighbors` report is shown: one table of nearest rows per query."""

from __future__ import annotations

import math

from rich.console import Group, RenderableType
from rich.text import Text

from embedlens.reports import register_view
from embedlens.reports.neighbors import NeighborsReport, QueryResult
from embedlens.views.format import Sheet, Words, count, shown


def _cosine(value: float) -> str:
    return f"{value:.4f}" if math.isfinite(value) else "n/a"


def _title(q: QueryResult) -> Words:
    title = Words("Nearest to ", style="bold")
    if q.kind == "id":
        return title.add(f"row {q.token_id} ").token(q.token or "")
    if q.kind == "expression":
        for i, t in enumerate(q.terms):
            if i or t.sign < 0:
                title.add(" - " if t.sign < 0 else " + ")
            title.token(t.token)
        return title
    title.token(q.query)
    if q.kind == "word" and len(q.rows) > 1:
        title.add(f" (mean of the unit rows {', '.join(str(r) for r in q.rows)})")
    elif q.kind == "word":
        title.add(f" (id {q.token_id}")
        if q.token != q.query:
            title.add(", token ").token(q.token or "")
        title.add(")")
    return title


def _caption(q: QueryResult) -> list[Text]:
    parts: list[Text] = []
    if q.kind == "expression":
        rows = ", ".join(str(r) for r in q.rows)
        parts.append(
            Text(f"unit rows {rows} combined and normalised; those rows are left out", style="dim")
        )
    # A word split into several tokens is said once, in the run's note on stderr (what was
    # queried, and --pool); the table's caption does not say it again.
    return parts


def render(r: NeighborsReport) -> RenderableType:
    """One table per query: rank, id, token, cosine."""
    parts: list[RenderableType] = []
    for q in r.queries:
        parts.append(_title(q))
        table = Sheet()
        table.add_column("#", justify="right")
        table.add_column("id", justify="right")
        table.add_column("token", no_wrap=True)
        table.add_column("cosine", justify="right")
        for rank, n in enumerate(q.neighbors, 1):
            table.add_row(str(rank), str(n.id), Words().token(n.token), _cosine(n.cosine))
        parts.append(table)
        parts.extend(_caption(q))
    left_out = [f"{count(r.padding_rows)} padding rows"] if r.padding_rows else []
    if r.special_excluded:
        left_out.append(f"{count(r.special_excluded)} special tokens")
    summary = (
        f"Cosine over {count(r.searched_rows)} rows of {r.tensor} "
        f"({'embedding' if r.matrix == 'input' else 'LM head'}"
        f"{', tied' if r.tied and r.matrix == 'output' else ''})"
    )
    if left_out:
        summary += "; left out: " + ", ".join(left_out)
    parts.append(shown(summary + ".", style="dim"))
    return Group(*parts)


register_view(NeighborsReport, render)
