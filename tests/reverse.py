"""`python -m pytest -p tests.reverse ...`: the tests collected, run in reversed order (in one
process, `-n 0`): CI runs the vocab and hub-range tests so once, each after the ones that ran
before it in the usual order, so that a figure that depends on what ran before in the process
shows."""

from __future__ import annotations

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The collected tests, last first."""
    items.reverse()
