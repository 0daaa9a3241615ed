"""Long lists of floats in a report's JSON are written apart (`reports.floats`), byte for byte
what json.dumps writes: on adversarial values, on lists it must leave alone, and on real
`vocab --json` output."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedlens.reports import Report
from embedlens.reports.floats import LONG, dumps_floats


def _same(values: list[float]) -> None:
    got = dumps_floats(values)
    assert got is not None, values[:8]
    assert got == json.dumps(values)


EDGES = [
    0.0, -0.0, 1e-06, -1e-06, 5e-06, 1e-05, 1.5e-05, 2e-05, 9.9e-05, 9e-05, 0.0001, -0.0001,
    0.000101, 0.00011, 0.001, 0.5, 3.0, -3.0, 10.0, 100.0, 999.999999, 1000.0, 1000.001,
    1001.1, 123456.7, 999999.999999, -999999.999999, 0.1, 0.2, 0.3, 0.7, 1 / 3, 2 / 3,
    0.123456, 0.999999, 1.000001, 12.000001, 100000.000001,
]  # fmt: skip


def test_edges_and_their_rounding() -> None:
    _same([round(x, 6) for x in EDGES])
    _same(np.round(np.array(EDGES), 6).tolist())


def test_every_small_multiple_of_a_millionth() -> None:
    """Around 10^-4, where repr turns to exponents, and around the halves of a millionth."""
    ks = np.arange(-300_000, 300_001)
    _same((ks / 1e6).tolist())
    _same(np.round((ks + 0.5) / 1e6, 6).tolist())
    _same([round((k + 0.5) / 1e6, 6) for k in range(-2_000, 2_000)])


@pytest.mark.parametrize("scale", [1e-5, 1e-3, 1.0, 1e2, 1e5])
def test_random_values_rounded(scale: float) -> None:
    rng = np.random.default_rng(int(scale * 1e5))
    x = rng.standard_normal(50_000) * scale
    x = x[np.abs(x) < 999_999]
    _same(np.round(x, 6).tolist())
    _same(np.round(x.astype(np.float32).astype(np.float64), 6).tolist())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(min_value=-999_999.0, max_value=999_999.0), min_size=1, max_size=50))
def test_any_rounded_floats(values: list[float]) -> None:
    _same([round(v, 6) for v in values])


@pytest.mark.parametrize(
    "values",
    [
        [],
        [1.0, math.nan],
        [1.0, math.inf],
        [1e6],
        [-1e6],
        [1e300],
        [1.5e-7],
        [0.1234567],
        [5e-324],
        [1.0, 2],
        [1.0, True],
        [1.0, None],
    ],
)
def test_other_lists_are_left_to_json(values: list[object]) -> None:
    assert dumps_floats(values) is None  # type: ignore[arg-type]


@dataclass(frozen=True)
class _Listed(Report):
    command: ClassVar[str] = "test"
    model: str
    values: list[float]
    others: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _plain_json(report: Report, indent: int | None = None) -> str:
    return json.dumps(report.to_dict(), ensure_ascii=False, allow_nan=False, indent=indent)


def test_report_json_is_json_dumps() -> None:
    values = np.round(np.random.default_rng(0).standard_normal(LONG), 6).tolist()
    report = _Listed("m", values, [*values[:-1], math.nan], notes=["é"])
    assert report.to_json() == _plain_json(report)
    assert report.to_json(indent=1) == _plain_json(report, indent=1)


def test_a_string_that_reads_as_a_mark_is_written_as_itself() -> None:
    values = [0.5] * LONG
    hostile = "\0embedlens-floats-0\0"
    report = _Listed(hostile, values, values, notes=[hostile])
    assert report.to_json() == _plain_json(report)
    assert json.loads(report.to_json())["model"] == hostile


@pytest.mark.parametrize("family", ["llama-tied", "llama-untied"])
def test_vocab_json_is_json_dumps(tiny, family: str) -> None:
    import embedlens

    report = embedlens.vocab(tiny(family))
    assert report.to_json() == _plain_json(report)


def test_vocab_json_is_json_dumps_on_smollm2(smollm2) -> None:
    """49,152 rows: the lists are written apart (LONG items or more)."""
    import embedlens

    report = embedlens.vocab(smollm2)
    scanned = report.to_dict()["undertrained"]
    assert dumps_floats(scanned["indicators"]) is not None
    assert dumps_floats(scanned["norms"]) is not None
    assert report.to_json() == _plain_json(report)
