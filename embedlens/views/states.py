"""How `lens --states` is shown: the `lens` tables, then where the states came from and what the
self-check could do with them."""

from __future__ import annotations

from embedlens.reports import register_view
from embedlens.reports.states import (
    StatesLensReport,
    StatesPairReport,
    StatesSitesPairReport,
    StatesSitesReport,
)
from embedlens.views import lens, lens_diff, sites

register_view(StatesLensReport, lens.render)
register_view(StatesSitesReport, sites.render)
register_view(StatesPairReport, lens_diff.render)
register_view(StatesSitesPairReport, sites.render_sites_pair)
