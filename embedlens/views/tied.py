"""How the `tied` report is shown: the evidence, the verdict and the savings."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from embedlens.reports import register_view
from embedlens.reports.tied import TiedReport
from embedlens.text import model_title
from embedlens.views.format import Sheet, count, share, shown, size


def _yes_no(value: bool | None) -> Text:
    if value is None:
        return Text("not checked", style="dim")
    return Text("yes" if value else "no", style="green" if value else "yellow")


def render(r: TiedReport) -> RenderableType:
    """Evidence, verdict and savings."""
    table = Sheet(
        title=shown(f"Is the LM head of {model_title(r.model)} the embedding?", "table.title")
    )
    table.add_column("evidence")
    table.add_column("says tied?")
    table.add_row("config: tie_word_embeddings", _yes_no(r.evidence.config))
    table.add_row(
        "checkpoint stores no separate head",
        _yes_no(
            None
            if r.evidence.checkpoint_has_lm_head is None
            else not r.evidence.checkpoint_has_lm_head
        ),
    )
    table.add_row("built model: head is the embedding", _yes_no(r.evidence.same_storage))
    v, d = r.shape
    verdict = shown(("TIED" if r.tied else "UNTIED") + f": {r.verdict}.", style="bold")
    lines: list[RenderableType] = [table, verdict]
    if r.tied:
        lines.append(
            shown(
                f"Sharing the [{count(v)}, {count(d)}] matrix saves {count(r.saved_params)} "
                f"parameters ({size(r.saved_bytes)} at {r.dtype or '?'}), "
                f"{share(r.saved_fraction)} of the model."
            )
        )
    else:
        lines.append(
            Text(f"The head is a second [{count(v)}, {count(d)}] matrix: nothing is shared.")
        )
    return Group(*lines)


register_view(TiedReport, render)
