"""How `lens --states` is shown: the `lens` tables, then where the states came from and what the
self-check could do with them."""

from __future__ import annotations

from rich.text import Text

from embedlens.reports import register_view
from embedlens.reports.lens import LensReport
from embedlens.reports.states import StatesLensReport, StatesSource
from embedlens.views import lens
from embedlens.views.format import shown


def render_states_check(r: LensReport, states: StatesSource) -> Text:
    """The self-check line of a states report, with the file and what was read of the model."""
    steps = " → ".join(["block " + str(r.num_layers), *r.steps])
    held = ", ".join(str(layer) for layer in states.layers)
    read = ", ".join(states.tensors_read) or "nothing"
    where = (
        f"States: '{states.file}' ({states.layout}'s layout, {states.dtype}, layers {held}); "
        f"read of the model: {read}. Decode: {steps}."
    )
    c = r.check
    if not states.checked:
        line = Text("? ", style="yellow")
        line.append_text(shown(f"self-check {states.check}. {where}"))
    elif c.ok:
        line = Text("✓ ", style="green")
        line.append_text(shown(f"self-check {states.check}. {where}"))
    else:
        line = Text("✗ NOT FAITHFUL ", style="bold red")
        line.append_text(
            shown(f"self-check: max |Δ| = {c.max_abs_logit_diff:.3g} > {c.tolerance:.0e}. {where}")
        )
    return line


register_view(StatesLensReport, lens.render)
