"""The Python API's surface: what `import embedlens` offers, and what it costs."""

from __future__ import annotations

import subprocess
import sys

import pytest

import embedlens

COMMANDS = ("params", "tied", "neighbors", "addr", "lens", "tune")


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


def test_a_report_shows_as_the_cli_prints_it_and_as_html(tiny, cli):
    """`rich.print(report)` gives the command's tables; Jupyter gets the same as HTML tables."""
    import io

    from rich.console import Console

    folder = tiny("llama-tied")
    report = embedlens.params(folder)
    buffer = io.StringIO()
    Console(file=buffer, width=140, color_system=None, highlight=False).print(report)
    assert buffer.getvalue() == cli("params", folder).stdout
    page = report._repr_html_()
    assert page.count("<table") == 1 and "<caption" in page and "decoder blocks" in page
    assert f"{report.total:,}" in page and "<script" not in page


def test_a_report_renders_in_a_fresh_python(tiny, cli):
    """The reports never import the views (they register themselves): `embedlens.<command>`
    imports them, so `rich.print` and a notebook show the report with nothing else imported,
    also when the function is imported from its own module."""
    folder = tiny("llama-tied")
    code = (
        "import io, sys\n"
        "from embedlens.analysis.params import params\n"
        "from rich.console import Console\n"
        "report = params(sys.argv[1])\n"
        "buffer = io.StringIO()\n"
        "Console(file=buffer, width=140, color_system=None, highlight=False).print(report)\n"
        "print(buffer.getvalue(), end='')\n"
        "print(report._repr_html_().count('<table'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(folder)], capture_output=True, text=True, check=True
    )
    assert out.stdout == cli("params", folder).stdout + "1\n"


def test_every_report_type_has_its_view():
    import importlib
    import pkgutil

    from embedlens import reports, views

    for info in pkgutil.iter_modules(reports.__path__):
        importlib.import_module(f"embedlens.reports.{info.name}")
    views.load_views()
    kinds = [reports.Report]
    for kind in kinds:
        kinds.extend(k for k in kind.__subclasses__() if k.__module__.startswith(reports.__name__))
    shown = {k.__name__ for k in kinds if k in reports._VIEWS}
    assert shown == {k.__name__ for k in kinds[1:]}
    assert {"LensReport", "LensSummaryReport", "VocabReport"} <= shown


def test_a_report_without_a_view_says_so():
    from embedlens.reports import Report

    class Unshown(Report):
        command = "unshown"

    with pytest.raises(LookupError, match=r"no view shows a Unshown: import embedlens\.views"):
        Unshown().__rich__()


def test_html_escapes_what_model_files_hold(tiny):
    from embedlens.views.format import shown
    from embedlens.views.html import to_html

    assert "&lt;b&gt;" in to_html(shown("<b>")) and "<b>" not in to_html(shown("<b>"))


@pytest.mark.slow  # draws with matplotlib
def test_a_lens_with_a_grid_shows_its_heatmap_in_a_notebook(tiny):
    report = embedlens.lens(tiny("llama-tied"), "Hello world", position="all")
    page = report._repr_html_()
    assert page.count("<table") == 2 and "<svg" in page and "Top-1 at every layer" in page
    assert "<svg" not in embedlens.lens(tiny("llama-tied"), "Hello world")._repr_html_()


def test_cli_choices_are_the_ones_the_library_checks():
    """The CLI's --dtype and --device-map choices (Literal types, cheap to import) name exactly
    the values the functions accept."""
    from typing import get_args

    from embedlens.analysis.lens import DEVICE_MAPS
    from embedlens.cli._options import DeviceMap, Dtype
    from embedlens.model.loading import DTYPES

    assert get_args(Dtype) == DTYPES
    assert get_args(DeviceMap) == DEVICE_MAPS
