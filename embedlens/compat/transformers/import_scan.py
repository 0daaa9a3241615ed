"""transformers' table of its models scanned once where importing a model class scans it twice.

`import transformers` reads every file under transformers/models (some 1,700 files in 560
folders) for the names each one exports, and importing the package `transformers.models`, which
every model class is in, reads them all again: the scan of a folder is cached
(`functools.lru_cache`), for the last 128 folders only. `scan_once()`, called before transformers
is imported, has that cache keep every folder's result, so the second scan finds them all (0.84 s
down to 0.05 s at a load of 5); the scan is the same function, so the import tables are the same.
Nothing is done where transformers is imported already, or where its scan is not the cached
function this expects (another transformers version).

Like `loading`, nothing here imports transformers at module level.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from embedlens.compat.transformers import release_fits

MODULE = "transformers.utils.import_utils"
SCAN = "create_import_structure_from_path"


def scan_once() -> None:
    """Before transformers is first imported: its scan of the model folders will be cached
    whole (see the module's docstring). Does nothing once transformers is imported."""
    if "transformers" in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    if not release_fits():  # another release, or EMBEDLENS_PLAIN=1: transformers as it is
        return
    sys.meta_path.insert(0, _Finder())


def cache_every_folder(module: ModuleType) -> bool:
    """Replace `module`'s folder scan (an `lru_cache` of 128 entries) with the same function
    cached without a limit; False (nothing changed) where the scan is not such a function."""
    scan = getattr(module, SCAN, None)
    plain = getattr(scan, "__wrapped__", None)
    if not callable(plain) or not hasattr(scan, "cache_info"):
        return False
    setattr(module, SCAN, functools.lru_cache(maxsize=None)(plain))
    return True


class _Finder(importlib.abc.MetaPathFinder):
    """Finds transformers' import utilities as Python would, and caches their scan whole once
    they have run; it leaves `sys.meta_path` as soon as it has found them."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != MODULE:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        loader: Any = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            cache_every_folder(module)

        loader.exec_module = exec_module
        return spec
