"""A plain install (no extras) holds every package embedlens' commands use."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", Requirement(requirement).name).lower()


def _dependencies() -> tuple[set[str], set[str]]:
    """(core, extras-only) distribution names from pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    core = {_name(r) for r in project["dependencies"]}
    extras = {_name(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    return core, extras - core


def _distributions_imported(*argv: str) -> set[str]:
    """Distributions whose modules an embedlens run imports (it must succeed)."""
    code = (
        "import sys\n"
        "from embedlens.cli import app\n"
        "try:\n    app(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('MODULES', *sorted({m.split('.')[0] for m in sys.modules}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    line = next(ln for ln in result.stdout.splitlines() if ln.startswith("MODULES "))
    found = packages_distributions()
    return {
        re.sub(r"[-_.]+", "-", dist).lower()
        for module in line.split()[1:]
        for dist in found.get(module, [])
    }


def test_the_core_dependencies_are_not_in_extras():
    core, extras_only = _dependencies()
    assert "accelerate" in core, "transformers needs accelerate to load any GGUF file"
    assert not core & extras_only


def test_loading_a_gguf_file_uses_no_package_from_an_extra(smollm2):
    """transformers refuses a GGUF load without accelerate; a plain install must have it."""
    _, extras_only = _dependencies()
    used = _distributions_imported("params", str(smollm2), "--load", "--quiet")
    assert "torch" in used  # the run really loaded the model
    assert not used & extras_only, f"a plain install lacks {sorted(used & extras_only)}"
