"""The shape of embedlens' code: no function longer than MAX_LINES lines, no module longer than
MAX_MODULE_LINES."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 60
MAX_MODULE_LINES = 500


def long_functions(source: str, limit: int = MAX_LINES) -> list[tuple[str, int, int]]:
    """(name, first line, length) of each function or method in source longer than limit."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno is not None
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                found.append((node.name, node.lineno, length))
    return found


def test_no_function_is_over_the_limit():
    files = sorted((ROOT / "embedlens").rglob("*.py"))
    assert len(files) > 20
    offenders = [
        f"{path.relative_to(ROOT).as_posix()}:{line} {name} ({length} lines)"
        for path in files
        for name, line, length in long_functions(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, f"functions over {MAX_LINES} lines:\n" + "\n".join(offenders)


def test_the_length_check_counts_every_line_of_a_function():
    """A function of exactly the limit passes; one line more (a method, async too) is caught."""
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES - 1))
    assert long_functions("def ok():\n" + body) == []
    over = (
        "class C:\n    async def too_long(self):\n"
        + body.replace("    ", "        ")
        + "        pass\n"
    )
    assert long_functions(over) == [("too_long", 2, MAX_LINES + 1)]


def long_modules(root: Path, limit: int = MAX_MODULE_LINES) -> list[tuple[str, int]]:
    """(path, lines) of each module under root longer than limit."""
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > limit:
            found.append((path.relative_to(root).as_posix(), lines))
    return found


def test_no_module_is_over_the_limit():
    offenders = long_modules(ROOT / "embedlens")
    listed = "\n".join(f"embedlens/{path} ({lines} lines)" for path, lines in offenders)
    assert not offenders, f"modules over {MAX_MODULE_LINES} lines (split by idea):\n" + listed


def test_the_module_check_counts_every_line(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "ok.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    (tmp_path / "pkg" / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert long_modules(tmp_path) == [("pkg/long.py", MAX_MODULE_LINES + 1)]
