"""transformers' model table is scanned once (embedlens.compat.transformers.import_scan): importing
`transformers.models` after `scan_once()` finds every folder's scan cached, and the import
tables it builds are the ones a plain import builds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

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


def tables(mode: str) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", TABLES, mode], capture_output=True, text=True, check=True, env=env
    )
    return json.loads(done.stdout)


def test_the_second_scan_is_cached_and_the_tables_are_the_same():
    plain, once = tables("plain"), tables("once")
    assert plain["hits"] == 0  # transformers' own 128-entry cache: every folder read again
    assert once["hits"] > 500  # the model folders, read once
    assert "_Finder" not in once["finders"]  # it left sys.meta_path once used
    for key in ("top", "models", "missing"):
        assert once[key] == plain[key]
    assert len(once["models"]) > 1000


def test_nothing_is_done_once_transformers_is_imported():
    import transformers  # noqa: F401

    before = list(sys.meta_path)
    import_scan.scan_once()
    assert sys.meta_path == before


def test_a_scan_that_is_not_an_lru_cache_is_left_alone():
    def scan(path: str) -> dict:
        return {}

    module = types.ModuleType("fake_import_utils")
    setattr(module, import_scan.SCAN, scan)
    assert not import_scan.cache_every_folder(module)
    assert getattr(module, import_scan.SCAN) is scan
