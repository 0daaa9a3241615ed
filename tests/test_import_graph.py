"""embedlens' imports go one way: no module imports itself back through others, no module
imports another's private name, and every import goes from a layer to itself or to a layer below
it along an edge the table of tests/layers.py allows (base < io < model < reports < analysis <
views < facade < cli; a new edge not in the table fails).

The graph is read from the sources with `ast`, so it holds every import statement wherever it
stands: at module level, inside functions (the lazy imports), and under `if TYPE_CHECKING:`.
Relative imports are resolved against the importing module's package; `from pkg import name`
counts as importing the module `pkg.name` when there is one, else as importing `pkg`;
`importlib.import_module("embedlens...")` with a literal name counts as an import too.

How a package `__init__` counts: it is a module like any other. Its own imports are its edges, and
importing a name from the package (`from embedlens.reports import Report`, `import
embedlens.views`) is an edge to it; so a re-export cycle (an `__init__` importing a submodule that
imports a name back from that `__init__`) is reported. Not counted is the implicit run of the
parents' `__init__` when `embedlens.a.b` is imported: a submodule that imports a sibling reads
nothing from its package's `__init__` (reading a name from it is an edge, counted as above), so an
`__init__` importing its own submodules never hands them a half-made module. Counting it would
make a cycle of every package whose `__init__` imports its own submodules (`embedlens.cli`
registering its commands) and of the root `embedlens/__init__.py` (a lazy façade whose imports of
every command run only for the type checker) with everything under it.

A private name is one with a leading underscore, not a dunder: `from embedlens.x import _helper`
in another module is refused, and so is importing a private module (`embedlens.cli._output`) from
outside the package that holds it.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.layers import ALLOWED, LAYERS, layer_name

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Import:
    """One imported module (and the name taken from it, for `from module import name`)."""

    importer: str
    module: str
    name: str | None
    where: str
    """file:line of the statement."""


def find_modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package under root, by dotted name (a package by its own name)."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _statements(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[str, str, int]]:
    """(module, name or '', line) for each name an import statement anywhere in tree takes."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((alias.name, "", node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: None if is_package else -1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            yield from ((base, alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.Call) and _is_import_module(node.func) and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                yield arg.value, "", node.lineno


def _is_import_module(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id == "import_module"
    )


def find_imports(root: Path, package: str) -> list[Import]:
    """Every import of a module of the package, by a module of the package."""
    modules = find_modules(root, package)
    found = []
    for importer, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        where = path.relative_to(root).as_posix()
        for module, name, line in _statements(tree, importer, path.name == "__init__.py"):
            if module != package and not module.startswith(package + "."):
                continue
            if name and f"{module}.{name}" in modules:  # from package import submodule
                module, name = f"{module}.{name}", ""
            found.append(Import(importer, module, name or None, f"{where}:{line}"))
    return found


def build_graph(imports: Iterable[Import]) -> dict[str, dict[str, Import]]:
    """importer -> imported module -> its first import statement (a module importing itself is
    no edge)."""
    graph: dict[str, dict[str, Import]] = {}
    for imp in imports:
        if imp.module != imp.importer:
            graph.setdefault(imp.importer, {}).setdefault(imp.module, imp)
    return graph


def _path(graph: dict[str, dict[str, Import]], start: str, goal: str) -> list[Import] | None:
    """The shortest chain of imports from start to goal, or None."""
    came: dict[str, Import | None] = {start: None}
    queue = deque([start])
    while queue:
        here = queue.popleft()
        if here == goal:
            chain = []
            while (step := came[here]) is not None:
                chain.append(step)
                here = step.importer
            return chain[::-1]
        for there, imp in sorted(graph.get(here, {}).items()):
            if there not in came:
                came[there] = imp
                queue.append(there)
    return None


def cycles(graph: dict[str, dict[str, Import]]) -> dict[str, str]:
    """Each import that lies on a cycle ('cycle: a -> b'), with the cycle through it."""
    found = {}
    for importer, targets in sorted(graph.items()):
        for module, imp in sorted(targets.items()):
            back = _path(graph, module, importer)
            if back is not None:
                shown = "\n".join(
                    f"    {i.importer} -> {i.module}  ({i.where})" for i in [imp, *back]
                )
                found[f"cycle: {importer} -> {module}"] = shown
    return found


def _private(part: str) -> bool:
    return part.startswith("_") and not part.endswith("__")


def private_imports(imports: Iterable[Import]) -> dict[str, str]:
    """Each import of another module's private name, or of a private module from outside the
    package that holds it ('private: a imports b._name'), with where it is."""
    found = {}
    for imp in imports:
        if imp.name is not None and _private(imp.name) and imp.module != imp.importer:
            found[f"private: {imp.importer} imports {imp.module}.{imp.name}"] = (
                f"    at {imp.where}"
            )
        parts = imp.module.split(".")
        for depth, part in enumerate(parts):
            holder = ".".join(parts[:depth])
            inside = imp.importer == holder or imp.importer.startswith(holder + ".")
            if _private(part) and not inside:
                found[f"private: {imp.importer} imports {imp.module}"] = f"    at {imp.where}"
    return found


def violations(root: Path, package: str) -> dict[str, str]:
    """Every cycle edge and private import of the package, with where each is."""
    imports = find_imports(root, package)
    return {**cycles(build_graph(imports)), **private_imports(imports)}


def _listing(found: dict[str, str]) -> str:
    return "\n".join(f"{key}\n{found[key]}" for key in sorted(found))


def test_embedlens_imports_go_one_way():
    found = violations(ROOT, "embedlens")
    assert not found, "imports that must go:\n" + _listing(found)


def layer_crossings(imports: Iterable[Import]) -> dict[str, str]:
    """Each import from one layer into another that `tests/layers.py` does not allow ('layers:
    a (layer) imports b (layer)'), with where it is."""
    found = {}
    for imp in imports:
        here, there = layer_name(imp.importer), layer_name(imp.module)
        if there not in ALLOWED[here]:
            key = f"layers: {imp.importer} ({here}) imports {imp.module} ({there})"
            found[key] = f"    at {imp.where}"
    return found


def test_every_import_is_an_allowed_edge_between_layers():
    """The allowed-edge table of tests/layers.py holds: an import from a layer into one its row
    does not name fails (a new kind of edge is added to the table on purpose, or not at all)."""
    found = layer_crossings(find_imports(ROOT, "embedlens"))
    assert not found, "imports across layers the table does not allow:\n" + _listing(found)


def test_the_layer_table_goes_one_way():
    """Each layer may import only itself and layers below it, and every module is in a layer."""
    for layer, targets in ALLOWED.items():
        assert layer in targets
        assert all(LAYERS.index(t) <= LAYERS.index(layer) for t in targets), layer
    assert set(ALLOWED) == set(LAYERS)
    for module in find_modules(ROOT, "embedlens"):
        layer_name(module)  # KeyError for a module in no layer


def test_a_new_edge_not_in_the_table_is_found():
    imports = [
        Import("embedlens.io.source", "embedlens.model.chat", "x", "io/source.py:1"),
        Import("embedlens.views.lens", "embedlens.analysis.lens", None, "views/lens.py:2"),
        Import("embedlens.model.loading", "embedlens.io.hub", None, "model/loading.py:3"),
    ]
    assert sorted(layer_crossings(imports)) == [
        "layers: embedlens.io.source (io) imports embedlens.model.chat (model)",
        "layers: embedlens.views.lens (views) imports embedlens.analysis.lens (analysis)",
    ]


def test_the_graph_sees_every_kind_of_import():
    imports = find_imports(ROOT, "embedlens")
    by = {(i.importer, i.module) for i in imports}
    assert ("embedlens.model.loading", "embedlens.model.preflight") in by  # from pkg import mod
    assert ("embedlens.views.html", "embedlens.reports") in by  # under TYPE_CHECKING
    assert ("embedlens.model.load_errors", "embedlens.io.hub") in by  # inside a function
    assert ("embedlens.__main__", "embedlens.cli") in by
    assert len(find_modules(ROOT, "embedlens")) > 60


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


@pytest.mark.parametrize(
    "files",
    [
        {"a.py": "def f():\n    from pkg import b\n", "b.py": "import pkg.a\n"},
        {
            "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
            "b.py": "import importlib\nimportlib.import_module('pkg.a')\n",
        },
        {"sub/__init__.py": "from .c import C\n", "sub/c.py": "from pkg.sub import D\n"},
        {"sub/__init__.py": "", "sub/c.py": "from .. import a\n", "a.py": "from .sub.c import X\n"},
    ],
    ids=["in a function", "type checking and importlib", "re-export", "relative"],
)
def test_a_cycle_is_found_however_it_is_imported(tmp_path, files):
    root = _package(tmp_path, {"pkg/__init__.py": "", **{f"pkg/{k}": v for k, v in files.items()}})
    found = violations(root, "pkg")
    assert found and all(key.startswith("cycle: ") for key in found), found
    assert all(detail.count(" -> ") >= 2 for detail in found.values())


def test_a_package_importing_its_own_submodules_is_no_cycle(tmp_path):
    root = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/cli/__init__.py": "from pkg.cli import run\nfrom pkg.cli._shared import x\n",
            "pkg/cli/run.py": "from pkg.cli._shared import x\nfrom . import _shared\n",
            "pkg/cli/_shared.py": "from pkg.core import y\n",
            "pkg/core.py": "y = 1\n",
        },
    )
    assert violations(root, "pkg") == {}


def test_a_private_name_or_module_from_elsewhere_is_found(tmp_path):
    root = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "_x = 1\n__all__ = []\n",
            "pkg/b.py": "from pkg.a import _x, __all__\n",
            "pkg/cli/__init__.py": "",
            "pkg/cli/_out.py": "",
            "pkg/c.py": "def f():\n    from pkg.cli import _out\n",
        },
    )
    assert violations(root, "pkg") == {
        "private: pkg.b imports pkg.a._x": "    at pkg/b.py:1",
        "private: pkg.c imports pkg.cli._out": "    at pkg/c.py:2",
    }
