"""transformers' model table is scanned once (embedlens.compat.transformers.import_scan): importing
`transformers.models` after `scan_once()` finds every folder's scan cached, and the import
tables it builds are the ones a plain import builds."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from embedlens.compat.transformers import import_scan

ROOT = Path(__file__).resolve().parent.parent

TABLES = """
import json, sys
if sys.argv[1] == "once":
    from embedlens.compat.transformers.import_scan import scan_once
    scan_once()
import transformers, transformers.models
from transformers.utils import import_utils
info = import_utils.create_import_structure_from_path.cache_info()
print(json.dumps({
    "hits": info.hits,
    "finders": [type(f).__name__ for f in sys.meta_path],
    "top": sorted(transformers._class_to_module.items()),
    "models": sorted(transformers.models._class_to_module.items()),
    "missing": sorted((k, sorted(map(str, v))) for k, v in
                      transformers.models._object_missing_backend.items()),
}))
"""


def tables(mode: str, **more: str) -> dict:
    env = {
        **{k: v for k, v in os.environ.items() if k != "EMBEDLENS_PLAIN"},
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        **more,
    }
    done = subprocess.run(
        [sys.executable, "-c", TABLES, mode], capture_output=True, text=True, check=True, env=env
    )
    return {**json.loads(done.stdout), "stderr": done.stderr}


def test_the_second_scan_is_cached_and_the_tables_are_the_same():
    plain, once = tables("plain"), tables("once")
    assert plain["hits"] == 0  # transformers' own 128-entry cache: every folder read again
    assert once["hits"] > 300  # the model folders, read once (412 on transformers 5.0)
    assert "_Finder" not in once["finders"]  # it left sys.meta_path once used
    for key in ("top", "models", "missing"):
        assert once[key] == plain[key]
    assert len(once["models"]) > 1000
    assert once["stderr"] == plain["stderr"] == ""


def test_plain_scans_as_transformers_does_and_says_nothing():
    plain, asked = tables("plain"), tables("once", EMBEDLENS_PLAIN="1")
    assert asked["hits"] == 0 and asked["stderr"] == ""
    for key in ("top", "models", "missing"):
        assert asked[key] == plain[key]


def test_nothing_is_done_once_transformers_is_imported():
    import transformers  # noqa: F401

    before = list(sys.meta_path)
    import_scan.scan_once()
    assert sys.meta_path == before


@pytest.fixture
def notes(monkeypatch, capsys):
    """The notes said on stderr since the test began (each said afresh)."""
    import embedlens.compat as plain

    plain.forget_said()
    capsys.readouterr()
    return lambda: [x for x in capsys.readouterr().err.splitlines() if x.startswith("note: ")]


NOTE = "note: transformers' model table is scanned as transformers scans it (slower to import)"


def test_a_scan_that_is_not_an_lru_cache_is_left_alone(notes):
    def scan(path: str) -> dict:
        return {}

    module = types.ModuleType("fake_import_utils")
    setattr(module, import_scan.SCAN, scan)
    assert not import_scan.cache_every_folder(module)
    assert getattr(module, import_scan.SCAN) is scan
    assert notes() == [f"{NOTE}: its {import_scan.SCAN} is not the one embedlens knows"]


@pytest.mark.parametrize("kind", ["missing", "two-arguments", "other-size"])
def test_a_scan_not_as_known_is_left_alone_with_a_note(notes, kind):
    """transformers' scan removed, given another signature, or another cache: left alone, and
    transformers scans as it does, with one note."""
    from transformers.utils import import_utils

    real = import_utils.create_import_structure_from_path.__wrapped__
    module = types.ModuleType("fake_import_utils")
    if kind == "two-arguments":
        setattr(module, import_scan.SCAN, functools.lru_cache(lambda module_path, more: {}))
    elif kind == "other-size":
        setattr(module, import_scan.SCAN, functools.lru_cache(maxsize=64)(real))
    before = getattr(module, import_scan.SCAN, None)
    assert not import_scan.cache_every_folder(module)
    assert getattr(module, import_scan.SCAN, None) is before
    assert len(notes()) == 1
    setattr(module, import_scan.SCAN, functools.lru_cache(real))  # as transformers has it
    assert import_scan.cache_every_folder(module)
    assert getattr(module, import_scan.SCAN).cache_parameters()["maxsize"] is None
    assert notes() == []


def test_a_release_outside_the_checked_ones_adds_no_finder(notes, monkeypatch):
    import embedlens.compat as plain

    monkeypatch.delitem(sys.modules, "transformers", raising=False)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    before = list(sys.meta_path)
    real = plain.release
    monkeypatch.setattr(plain, "release", lambda d: (5, 99) if d == "transformers" else real(d))
    import_scan.scan_once()
    assert sys.meta_path == before
    assert notes() == [f"{NOTE}: transformers 5.99 is not a release from 5.0 to 5.25"]
    monkeypatch.setattr(plain, "release", real)
    import_scan.scan_once()  # a release checked: the finder
    assert [type(f).__name__ for f in sys.meta_path] == [
        "_Finder",
        *(type(f).__name__ for f in before),
    ]
