"""How reports are shown: Rich tables, HTML for notebooks, and heatmap pictures.

Each view module registers how it shows its report with `embedlens.reports` when it is imported
(reports never import the views, which import them). Importing this package is cheap (no Rich)
and lets every report render: the first report shown without its view imports them all.
"""

from __future__ import annotations

from embedlens.reports import set_view_loader


def load_views() -> None:
    """Import every view module; each registers how its reports are shown."""
    from embedlens.views import (  # noqa: F401
        addr,
        html,
        lens,
        lens_parity,
        lens_text,
        neighbors,
        params,
        tied,
        tune,
        vocab,
    )


set_view_loader(load_views)
