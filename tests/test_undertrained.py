"""The under-trained scan's numerics: Lanczos for the first principal component, Q8_0 rows."""

from __future__ import annotations

import numpy as np
import pytest

from embedlens.analysis.undertrained import EXACT_WIDTH, first_component, top_eigenvector


def _exact_top(a: np.ndarray) -> np.ndarray:
    return np.linalg.eigh(a)[1][:, -1]


def test_lanczos_matches_eigh_with_a_dominant_component():
    rng = np.random.default_rng(1)
    shared = rng.standard_normal(300)
    rows = rng.standard_normal((2000, 300)) + 4.0 * rng.standard_normal((2000, 1)) * shared
    covariance = np.cov(rows, rowvar=False)
    u, steps, residual = top_eigenvector(covariance)
    assert residual <= 1e-9
    assert steps < 40  # a dominant component converges in a few checks
    assert abs(float(u @ _exact_top(covariance))) == pytest.approx(1.0, abs=1e-12)


def test_lanczos_matches_eigh_without_a_dominant_component():
    """Random rows: the top two eigenvalues are within 1% and Lanczos still finds the first."""
    rows = np.random.default_rng(2).standard_normal((4000, 400))
    covariance = np.cov(rows, rowvar=False)
    values = np.linalg.eigvalsh(covariance)
    assert values[-1] / values[-2] < 1.05
    u, _, residual = top_eigenvector(covariance)
    assert residual <= 1e-9
    assert abs(float(u @ _exact_top(covariance))) == pytest.approx(1.0, abs=1e-8)


def test_lanczos_on_a_rank_one_matrix_stops_early():
    v = np.arange(1.0, 301.0)
    u, steps, _ = top_eigenvector(np.outer(v, v))
    assert steps <= 8
    assert abs(float(u @ v)) / np.linalg.norm(v) == pytest.approx(1.0, abs=1e-12)


def test_smollm2_first_component_is_the_exact_one(smollm2):
    """On the real model (d = 576, above EXACT_WIDTH): Lanczos gives eigh's vector for the same
    sampled covariance."""
    from embedlens.io.source import resolve
    from embedlens.model.matrix import locate, open_rows

    source = resolve(str(smollm2))
    table = locate(source, "output")
    rows = open_rows(source, table)
    assert rows.shape[1] > EXACT_WIDTH
    u, how = first_component(rows)
    assert how.startswith("Lanczos")
    v = rows.shape[0]
    sample = rows.take(list(range(0, v, -(-v // 16384)))).astype(np.float64)
    covariance = np.cov(sample, rowvar=False, bias=True)
    assert abs(float(u @ _exact_top(covariance))) == pytest.approx(1.0, abs=1e-6)


def test_q8_0_rows_are_ggufs():
    import gguf
    from gguf.quants import dequantize, quantize

    from embedlens.model.matrix import _dequantize_q8_0

    q8 = gguf.GGMLQuantizationType.Q8_0
    x = np.random.default_rng(3).standard_normal((70, 128)).astype(np.float32)
    x[5] *= 1e4  # large scales
    raw = quantize(x, q8)
    assert np.array_equal(_dequantize_q8_0(raw, 128, None), dequantize(raw, q8))
    out = np.empty((70, 128), np.uint32)
    assert np.array_equal(_dequantize_q8_0(raw, 128, out), dequantize(raw, q8))


def test_passes_give_the_same_figures_on_any_number_of_threads(smollm2, monkeypatch):
    """The passes split the rows between threads (one per core); the reference rows' mean adds
    the blocks' sums in order, so a machine with more cores prints the same figures. On the
    real model (49,152 Q4_1 rows; 20,000 reference rows, more than are taken one by one)."""
    from embedlens.analysis import undertrained
    from embedlens.io.source import resolve
    from embedlens.model.matrix import locate, open_rows

    source = resolve(str(smollm2))
    rows = open_rows(source, locate(source, "output"))
    reference = list(range(0, 40_000, 2))
    assert len(reference) > undertrained.SAMPLE_ROWS
    seen = []
    for n in (1, 2, 3):
        monkeypatch.setattr(undertrained, "workers", lambda v, n=n: n)
        stats = undertrained.row_stats(rows, reference)
        seen.append((undertrained.reference_mean(rows, reference), stats))
    (mean, first), others = seen[0], seen[1:]
    for other_mean, stats in others:
        assert np.array_equal(other_mean, mean)
        assert np.array_equal(stats.indicator, first.indicator, equal_nan=True)
        assert np.array_equal(stats.norms, first.norms)
        assert np.array_equal(stats.signature, first.signature)
        assert np.array_equal(stats.mean_distance, first.mean_distance)
    single = np.asarray(rows.take(reference), dtype=np.float64).mean(axis=0)
    assert np.allclose(mean, single, rtol=1e-5, atol=1e-7)
