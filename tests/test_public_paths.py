"""Shortcuts through other libraries' private parts take the public path, with the same output,
where what they rely on is not there (a release or a signature they were not written against:
one `note:` says so) and wherever EMBEDLENS_PLAIN=1 is set (no note)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import pytest

import embedlens.compat as compat
from embedlens.compat.jinja2 import _jinja_fits as jinja_fits

WORKING = (
    "{% set tools = [{'name': 'f', 'parameters': {'type': 'object'}}] %}"
    "{{ tools|tojson(indent=2) }}{{ '%s-%d' % ('a', 3) }}{{ '{}:{:>4}'.format('a', 'b') }}"
    "{{ 'x'|center(5) }}{{ 'a\\nb'|indent(2) }}{{ ['p', 'q']|join(', ') }}"
    "{% for m in messages %}<s> {{ m['role'] ~ ' ' + m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> {% endif %}"
)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Notes said afresh; no EMBEDLENS_PLAIN from outside; Jinja's fit found again."""

    compat.forget_said()
    monkeypatch.delenv("EMBEDLENS_PLAIN", raising=False)
    jinja_fits.cache_clear()
    yield
    jinja_fits.cache_clear()


def _notes(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("note: ")]


def _render(template: str = WORKING) -> str:
    """The template rendered within embedlens' bounds, in a sandbox made as transformers makes
    its own (a fresh one: nothing compiled under other checks)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from embedlens.model import chat

    def render() -> str:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        messages = [{"role": "user", "content": "hello"}]
        return str(env.from_string(template).render(messages=messages, add_generation_prompt=True))

    return chat.render(render, limit=4096, what="t")


def test_the_plain_switch(monkeypatch):
    for value, expected in [("", False), ("0", False), (" 0 ", False), ("1", True), ("yes", True)]:
        monkeypatch.setenv("EMBEDLENS_PLAIN", value)
        assert compat.plain() is expected
    assert compat.release("jinja2") is not None and compat.release("no-such-dist-xyz") is None
    assert compat.within("jinja2", (3, 1), (3, 2))
    assert not compat.within("jinja2", (3, 2), (9, 0))


# --- chat templates: the checks inside Jinja's sandbox -------------------------------------


def test_a_changed_jinja_renders_the_template_as_transformers_does_with_a_note(capsys, monkeypatch):
    from jinja2.sandbox import SandboxedEnvironment

    from embedlens.errors import ConfigError

    checked = _render()
    with pytest.raises(ConfigError, match="computes a value of about"):
        _render("{{ 'x' * 10**6 }}")
    assert _notes(capsys.readouterr().err) == []
    original = SandboxedEnvironment.wrap_str_format

    def other_signature(self: Any, value: Any, *, extra: bool = False) -> Any:
        return original(self, value)

    monkeypatch.setattr(SandboxedEnvironment, "wrap_str_format", other_signature)
    jinja_fits.cache_clear()
    assert _render() == checked
    assert _notes(capsys.readouterr().err) == [
        "note: the chat template renders without embedlens' checks inside Jinja: jinja2's "
        "SandboxedEnvironment.wrap_str_format is not as in 3.1"
    ]
    assert _render() == checked
    assert _notes(capsys.readouterr().err) == []  # one note a process
    with pytest.raises(ConfigError, match="renders more than 4,096 characters"):
        _render("{{ 'x' * 10**6 }}")  # the size is checked once rendered


def test_a_jinja_release_not_checked_renders_plainly_with_a_note(capsys, monkeypatch):

    checked = _render()
    real = compat.release
    monkeypatch.setattr(compat, "release", lambda d: (3, 2, 0) if d == "jinja2" else real(d))
    jinja_fits.cache_clear()
    assert _render() == checked
    notes = _notes(capsys.readouterr().err)
    assert len(notes) == 1 and "jinja2 " in notes[0] and "is not a 3.1 release" in notes[0]


def test_plain_renders_with_no_hook_in_jinja_and_says_nothing(capsys, monkeypatch):
    import jinja2
    import jinja2.runtime
    from jinja2.sandbox import SandboxedEnvironment

    from embedlens.model import chat

    checked = _render()
    monkeypatch.setenv("EMBEDLENS_PLAIN", "1")
    assert _render() == checked
    assert _notes(capsys.readouterr().err) == []
    before = {
        "sandbox": dict(vars(SandboxedEnvironment)),
        "concat": jinja2.Environment.__dict__["concat"],
        "joins": (jinja2.runtime.str_join, jinja2.runtime.markup_join),
    }

    def render() -> str:
        now = {
            "sandbox": dict(vars(SandboxedEnvironment)),
            "concat": jinja2.Environment.__dict__["concat"],
            "joins": (jinja2.runtime.str_join, jinja2.runtime.markup_join),
        }
        assert now == before
        env = SandboxedEnvironment()
        return str(env.from_string("{{ 'ab' * 3 }}").render())

    assert chat.render(render, limit=100, what="t") == "ababab"
    monkeypatch.delenv("EMBEDLENS_PLAIN")
    with pytest.raises(AssertionError):  # the checks do hook Jinja (the test can fail)
        chat.render(render, limit=100, what="t")


def test_the_output_bound_leaves_a_render_outside_it_alone():
    """The join that bounds the output acts inside `render` only: a render elsewhere, while
    one is under way (another thread), joins as Jinja does."""
    import threading

    import jinja2

    from embedlens.model import chat

    seen: list[str] = []

    def elsewhere() -> None:
        seen.append(jinja2.Environment().from_string("{{ 'x' * 50 }}").render())

    def render() -> str:
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
        return "ok"

    assert chat.render(render, limit=10, what="t") == "ok"
    assert seen == ["x" * 50]


# --- gguf's reader, as addr checks a GGUF's rows against it ----------------------------------


def _reader_rows(smollm2: Any) -> list[bytes]:
    from embedlens.io.reference import gguf_reader_rows
    from embedlens.io.source import resolve
    from embedlens.model.matrix import locate

    table = locate(resolve(str(smollm2), None), "input")
    assert table.checkpoint.gguf is not None
    return gguf_reader_rows(table.checkpoint.gguf, table.entry.name, [0, 42, 4197])


def test_gguf_reader_changed_reads_the_whole_header_with_a_note(smollm2, capsys, monkeypatch):
    from gguf import GGUFReader

    quick = _reader_rows(smollm2)
    assert _notes(capsys.readouterr().err) == []
    real = GGUFReader._get

    def other_signature(self: Any, offset: int, dtype: Any, count: int = 1, **more: Any) -> Any:
        return real(self, offset, dtype, count, more.get("override_order"))

    monkeypatch.setattr(GGUFReader, "_get", other_signature)
    assert _reader_rows(smollm2) == quick
    assert _notes(capsys.readouterr().err) == [
        "note: gguf's reader reads the whole header to check the rows (slower): gguf's "
        "GGUFReader._get is not as embedlens knows it"
    ]


def test_gguf_release_not_checked_and_plain_read_the_whole_header(smollm2, capsys, monkeypatch):
    from embedlens.io import reference

    quick = _reader_rows(smollm2)
    whole: list[Any] = []
    plain_reader = reference.plain_reader
    monkeypatch.setattr(reference, "plain_reader", lambda h: whole.append(h) or plain_reader(h))
    real = compat.release
    monkeypatch.setattr(compat, "release", lambda d: (0, 20) if d == "gguf" else real(d))
    assert _reader_rows(smollm2) == quick and len(whole) == 1
    notes = _notes(capsys.readouterr().err)
    assert len(notes) == 1 and "gguf's release is not one from 0.10 to 0.19" in notes[0]
    monkeypatch.setattr(compat, "release", real)
    monkeypatch.setenv("EMBEDLENS_PLAIN", "1")
    assert _reader_rows(smollm2) == quick and len(whole) == 2
    assert _notes(capsys.readouterr().err) == []
    monkeypatch.delenv("EMBEDLENS_PLAIN")
    assert _reader_rows(smollm2) == quick and len(whole) == 2  # the quick reader again


# --- gguf's table of types, read from its constants module alone ------------------------------


def _table(constants: Any) -> dict[int, tuple[str, int, int]]:
    sizes = constants.GGML_QUANT_SIZES
    return {int(t): (t.name, *sizes[t]) for t in constants.GGMLQuantizationType if t in sizes}


def test_gguf_constants_alone_or_from_the_package_give_the_same_table(capsys, monkeypatch):
    import importlib

    from embedlens.compat import gguf as ours
    from embedlens.errors import MissingDependencyError

    alone = ours.constants()
    assert alone.__name__ == "embedlens._gguf_constants"
    try:
        package = importlib.import_module("gguf.constants")
    except ImportError as e:  # gguf 0.10 imports sentencepiece, which it does not require
        monkeypatch.setenv("EMBEDLENS_PLAIN", "1")
        with pytest.raises(MissingDependencyError, match="fails to import"):
            ours.constants()
        assert "sentencepiece" in str(e)
        return
    assert _table(alone) == _table(package) and len(_table(alone)) > 20
    monkeypatch.setenv("EMBEDLENS_PLAIN", "1")
    assert ours.constants() is package
    assert _notes(capsys.readouterr().err) == []
    monkeypatch.delenv("EMBEDLENS_PLAIN")
    real = compat.release
    monkeypatch.setattr(compat, "release", lambda d: (0, 20) if d == "gguf" else real(d))
    assert ours.constants() is package
    assert _notes(capsys.readouterr().err) == [
        "note: gguf's table of types comes from `import gguf` (slower): gguf's release is not "
        "one from 0.10 to 0.19"
    ]


# --- no other library's private name outside the fenced places ---------------------------------

LIBRARIES = {
    "torch",
    "transformers",
    "huggingface_hub",
    "rich",
    "typer",
    "gguf",
    "numpy",
    "tokenizers",
    "safetensors",
    "accelerate",
    "jinja2",
    "httpx",
    "httpx2",
}
COMPAT = ("embedlens", "compat")
"""The fence: every use of another library's private parts is in a module under it."""


def private_names(source: str) -> list[tuple[int, str]]:
    """(line, text) of each import of a private module or name of LIBRARIES, each private
    attribute of a name bound by such an import, and each getattr-like call with a private
    name (embedlens' own `_embedlens...` marks apart). A private attribute of an object a
    library made (`console._width`) is not seen: no type is known here."""
    import ast

    tree = ast.parse(source)
    bound: set[str] = set()
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in LIBRARIES:
                    bound.add(alias.asname or parts[0])
                    if any(p.startswith("_") for p in parts):
                        found.append((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIBRARIES:
            module = node.module or ""
            if any(p.startswith("_") for p in module.split(".")):
                found.append((node.lineno, f"from {module}"))
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                if alias.name.startswith("_"):
                    found.append((node.lineno, f"from {module} import {alias.name}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                found.append((node.lineno, ast.unparse(node)))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and not node.args[1].value.startswith("_embedlens")
        ):
            found.append((node.lineno, ast.unparse(node)))
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_the_scan_finds_private_names():
    source = (
        "import torch\nfrom torch._C import x\nfrom rich.console import Console\n"
        "import huggingface_hub.utils._http as h\n"
        "Console()._width = 1\ntorch._C.y\ngetattr(m, '_extra', None)\nz._private\n"
        "getattr(f, '_embedlens_checked', None)\ntorch.__version__\n"
    )
    assert sorted(line for line, _ in private_names(source)) == [2, 4, 6, 7]


def _sources() -> dict[str, str]:
    """{path from the repository's root: text} of every module of embedlens."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    return {
        path.relative_to(root).as_posix(): path.read_text(encoding="utf-8")
        for path in sorted((root / "embedlens").rglob("*.py"))
    }


def _outside_the_fence(path: str) -> bool:
    return tuple(path.split("/")[:2]) != COMPAT


def test_no_private_name_of_another_library_outside_the_fence():
    found = [
        f"{path}:{line}: {text}"
        for path, source in _sources().items()
        if _outside_the_fence(path)
        for line, text in private_names(source)
    ]
    assert found == []


OWN_ELSEWHERE = {
    "os._exit": "the standard library's documented exit without clean-up",
    "'_float_tensor'": "a buffer's name in some checkpoints (fairseq's), not an attribute read",
    "'_blocks'": "the suffix of gpt-oss's MXFP4 tensor names (`X_blocks`), not an attribute read",
}
"""Private-looking names outside the fence that are no other library's private parts."""


def own_names(sources: Iterable[str]) -> set[str]:
    """Every name embedlens defines itself: functions, classes, variables, parameters,
    attributes set on `self` or `cls`, imported aliases."""
    import ast

    names: set[str] = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[0])
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                names.add(node.attr)
    return names


def foreign_private_names(source: str, own: set[str]) -> list[tuple[int, str]]:
    """(line, text) of each private attribute read or written (`x._name`), and each private
    name in a string (`getattr(torch, "_foreach_copy_")`), that embedlens does not define
    itself: another library's, whatever object it is reached through (an `nn.Module`'s
    `_parameters`, a reader's `super()._get`). embedlens' own `_embedlens...` marks apart."""
    import ast

    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        name, text = None, ""
        if isinstance(node, ast.Attribute):
            name, text = node.attr, ast.unparse(node)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            name, text = node.value, repr(node.value)
        if (
            name is not None
            and name.isidentifier()
            and _private(name)
            and not name.startswith("_embedlens")
            and name not in own
            and text not in OWN_ELSEWHERE
        ):
            found.append((node.lineno, text))
    return found


def test_the_wider_scan_finds_private_parts_of_objects_another_library_made():
    source = (
        "class R(Reader):\n    def f(self):\n        return super()._get(1)\n"
        "def g(module, own):\n    module._parameters['w'] = 1\n    own._mine = 2\n"
        "    getattr(torch, '_foreach_copy_')\n    os._exit(0)\n"
    )
    own = own_names([source, "class X:\n    def __init__(self):\n        self._mine = 0\n"])
    found = sorted(foreign_private_names(source, own))
    assert found == [
        (3, "super()._get"),
        (5, "module._parameters"),
        (7, "'_foreach_copy_'"),
    ]


def test_no_private_part_of_another_library_outside_the_fence():
    """The wider scan: no private attribute outside compat/ that embedlens does not define."""
    sources = _sources()
    own = own_names(sources.values())
    found = [
        f"{path}:{line}: {text}"
        for path, source in sources.items()
        if _outside_the_fence(path)
        for line, text in foreign_private_names(source, own)
    ]
    assert found == []


def test_the_fence_holds_one_module_per_library():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "embedlens" / "compat"
    modules = {p.stem for p in root.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert modules == {"__init__", "transformers", "torch", "gguf", "jinja2", "click"}
