"""The report of `lens --states`: the lens on hidden states a file holds, decoded without the
model's blocks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from embedlens.reports.lens import LensReport
from embedlens.reports.lens_diff import LensPairReport
from embedlens.reports.sites import LensSitesPairReport, LensSitesReport
from embedlens.reports.tune import TunedLens


@dataclass(frozen=True)
class StatesSource:
    """Where the states came from, and what was read to decode them."""

    file: str
    layout: str
    """'embedlens' (`lens --save-states`) or 'vllm' (vLLM's hidden-states connector)."""
    layers: list[int]
    """The layers the file holds (0 = the embedding output, i = block i's output)."""
    dtype: str
    """The states' dtype in the file."""
    checked: bool
    """Whether the decoding of the last layer was compared with the model's own logits."""
    check: str
    """What the self-check did, or why it was not made."""
    tensors_read: list[str] = field(default_factory=list)
    """The checkpoint tensors read to decode (by their names in the checkpoint): the ones that
    run after the last block."""
    metadata: dict[str, str] = field(default_factory=dict)
    """The file's own metadata (embedlens' file: model, revision, dtype, prompt, layers)."""


@dataclass(frozen=True)
class StatesLensReport(LensReport):
    """`lens MODEL --states FILE`: the `lens` report of the states a file holds, decoded by the
    model's final norm, head and post-head steps alone; `check` is null (JSON) when the file
    holds no logits of the model to check against."""

    tuned: TunedLens | None = None
    states: StatesSource | None = None

    def _json_object(self, lists: dict[str, str] | None) -> dict[str, Any]:
        out = super()._json_object(lists)
        if self.states is not None and not self.states.checked:
            out["check"] = None
        return out


@dataclass(frozen=True)
class StatesSitesReport(StatesLensReport, LensSitesReport):
    """`lens MODEL --states FILE --site SITES`: the `lens --site` report of the sites the file
    holds, with `states`."""


@dataclass(frozen=True, kw_only=True)
class StatesPairReport(StatesLensReport, LensPairReport):
    """`lens A --states FILE --against B`: the `lens --against` report of the file's states
    (A's) against B run on the file's ids, with `states`."""


@dataclass(frozen=True, kw_only=True)
class StatesSitesPairReport(StatesLensReport, LensSitesPairReport):
    """`lens A --states FILE --against B --site SITES`: the `lens --against --site` report of
    the file's states against B's, with `states`."""


def states_report(
    values: dict[str, Any], tuned: TunedLens | None, states: StatesSource
) -> StatesLensReport:
    """A lens report's fields (`lens`'s, `lens --site`'s or `lens --against`'s) with where its
    states came from."""
    values = {**values, "tuned": tuned, "states": states}
    if "diff" in values:
        kind = StatesSitesPairReport if "sites" in values else StatesPairReport
        return kind(**values)
    return StatesSitesReport(**values) if "sites" in values else StatesLensReport(**values)
