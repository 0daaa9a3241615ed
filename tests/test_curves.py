"""`lens --prompts --plot`: whole layers on the axis, and a KL panel where later layers show."""

from __future__ import annotations

import pytest

from embedlens.reports.lens import LensLayerStats, LensSummaryReport

pytest.importorskip("matplotlib")

# As on SmolLM2: about 100 nats at the embedding, a few nats or less late, 0 at the output.
KL = {0: 99.529, 8: 25.876, 16: 33.608, 24: 3.0, 28: 1.0, 29: 0.5, 30: 0.0}


def _report(kl: dict[int, float]) -> LensSummaryReport:
    layers = [
        LensLayerStats(layer, value, 1.0, 0.5, 0.1, -2.3, 10.0) for layer, value in kl.items()
    ]
    return LensSummaryReport(
        model="m", n_prompts=6, n_positions=6, n_skipped=0, n_targets=6, position=-1,
        num_layers=max(kl), dtype="float32", layers=layers,
    )  # fmt: skip


def _axes(report: LensSummaryReport):
    import matplotlib.pyplot as plt

    from embedlens.views.curves import figure

    fig = figure(report)
    fig.canvas.draw()
    return fig, [ax for ax in fig.axes if ax.get_visible()], plt


def test_layer_ticks_are_whole_layers():
    """Four layers (a 3-block model) on a default axis get ticks at 0.5, 1.5, ...: not layers."""
    fig, axes, plt = _axes(_report({0: 9.0, 1: 4.0, 2: 2.0, 3: 0.0}))
    try:
        for ax in axes:
            low, high = ax.get_xlim()
            shown = [t for t in ax.get_xticks() if low <= t <= high]
            assert shown and all(float(t).is_integer() for t in shown), shown
    finally:
        plt.close(fig)


def test_later_layers_stay_readable_beside_layer_0s_kl():
    """Layer 0's 99.5 nats must not flatten the rest: KL 1 and 3 nats lie a visible part of the
    panel's height apart (2% of it on a linear axis up to 100), and the output's 0 is drawn."""
    fig, axes, plt = _axes(_report(KL))
    try:
        kl = axes[0]
        assert kl.get_title().startswith("KL")
        to_axes = kl.transData + kl.transAxes.inverted()
        (_, y0), (_, y24), (_, y28), (_, y29), (_, y30) = to_axes.transform(
            [(layer, KL[layer]) for layer in (0, 24, 28, 29, 30)]
        )
        assert y24 - y28 > 0.08
        assert 0.0 <= y30 < y29 < y28 < y24 < y0 <= 1.0
    finally:
        plt.close(fig)
