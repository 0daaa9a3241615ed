"""transformers' table of its models scanned once where importing a model class scans it twice.

`import transformers` reads every file under transformers/models (some 1,700 files in 560
folders) for the names each one exports, and importing the package `transformers.models`, which
every model class is in, reads them all again: the scan of a folder is cached
(`functools.lru_cache`), for the last 128 folders only. `scan_once()`, called before transformers
is imported, has that cache keep every folder's result, so the second scan finds them all (0.84 s
down to 0.05 s at a load of 5); the scan is the same function, so the import tables are the same.
Nothing is done where transformers is imported already, with EMBEDLENS_PLAIN=1, or (with one
note) on a transformers release outside CHECKED or whose scan is not the function this expects (one
`module_path` argument, cached for 128 folders).

The hook is a finder on `sys.meta_path`, Python's public way to act on a module as it is
imported: the scan runs while `import transformers` runs, so nothing done before or after the
import could change the cache it uses.

Like `loading`, nothing here imports transformers at module level.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

MODULE = "transformers.utils.import_utils"
SCAN = "create_import_structure_from_path"


CHECKED = ((5, 0), (5, 26))
"""The transformers releases whose scan this was checked against: 5.0 to 5.25 (CI's lowest and
newest, and those between)."""
_PUBLIC = "transformers' model table is scanned as transformers scans it (slower to import)"


def scan_once() -> None:
    """Before transformers is first imported: its scan of the model folders will be cached
    whole (see the module's docstring). Does nothing once transformers is imported, with
    EMBEDLENS_PLAIN=1, or (one note) on a release outside CHECKED."""
    from embedlens.compat import checked_release, public_path, release

    if "transformers" in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    fits = checked_release("transformers", *CHECKED)
    if fits is None:
        return
    if not fits:
        got = ".".join(map(str, release("transformers") or ())) or "not installed"
        public_path(f"{_PUBLIC}: transformers {got} is not a release from 5.0 to 5.25")
        return
    sys.meta_path.insert(0, _Finder())


def quiet() -> None:
    """transformers imported, its model table scanned once (`scan_once`), its warnings and
    progress bars off: what every load does before it asks transformers for anything. In a
    library call all of it is put back when the call ends (`embedlens.guest`)."""
    import os

    from embedlens.guest import quietly_kept

    scan_once()
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers.utils import logging

    quietly_kept()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()
    # accelerate warns through plain logging that offloaded weights sit on the meta device
    import logging as stdlib_logging

    stdlib_logging.getLogger("accelerate").setLevel(stdlib_logging.ERROR)


def cache_every_folder(module: ModuleType) -> bool:
    """Replace `module`'s folder scan (an `lru_cache` of 128 entries of a function of one
    `module_path`) with the same function cached without a limit; False (nothing changed, one
    note) where the scan is not such a function."""
    scan = getattr(module, SCAN, None)
    plain: Any = getattr(scan, "__wrapped__", None)
    if not _is_the_scan(scan, plain):
        from embedlens.compat import public_path

        public_path(f"{_PUBLIC}: its {SCAN} is not the one embedlens knows")
        return False
    setattr(module, SCAN, functools.lru_cache(maxsize=None)(plain))
    return True


def _is_the_scan(scan: Any, plain: Any) -> bool:
    """`scan` is `functools.lru_cache(maxsize=128)` around `plain(module_path)`."""
    try:
        params = list(inspect.signature(plain).parameters)
        cached = scan.cache_parameters()
    except (TypeError, ValueError, AttributeError):
        return False
    return params == ["module_path"] and cached == {"maxsize": 128, "typed": False}


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
