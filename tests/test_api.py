"""The Python API's surface: what `import embedlens` offers, and what it costs."""

from __future__ import annotations

import subprocess
import sys

import pytest

import embedlens

COMMANDS = ("params", "tied", "neighbors", "addr", "lens")


def test_importing_embedlens_loads_nothing_heavy():
    code = (
        "import sys, embedlens\n"
        "print(sorted(m for m in ('torch', 'transformers', 'numpy', 'rich') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_is_a_function(name: str):
    fn = getattr(embedlens, name)
    assert callable(fn) and fn.__name__ == name and fn.__doc__
    assert name in dir(embedlens) and name in embedlens.__all__


def test_errors_are_exported_with_their_exit_codes():
    assert issubclass(embedlens.UsageError, embedlens.EmbedlensError)
    assert embedlens.UsageError.exit_code == 2 and embedlens.CheckpointError.exit_code == 1
    assert embedlens.UsageError("x", hint="y").hint == "y"


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = embedlens.nope  # type: ignore[attr-defined]


def test_the_version_is_the_package_version(cli):
    from importlib.metadata import version

    assert embedlens.__version__ == version("embedlens")
    assert cli("--version").stdout == f"embedlens {embedlens.__version__}\n"
