"""Shortcuts through other libraries' private parts take the public path, with the same output,
where what they rely on is not there (a release or a signature they were not written against:
one `note:` says so) and wherever EMBEDLENS_PLAIN=1 is set (no note)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import embedlens.compat as compat
from embedlens.compat.jinja import _jinja_fits as jinja_fits

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

    from embedlens.errors import MissingDependencyError
    from embedlens.compat import gguf as ours

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
FENCED = {
    "embedlens/model/direct.py",  # transformers' loading, being fenced into embedlens/compat
    "embedlens/model/gguf_patches.py",
    "embedlens/model/prefetch.py",
}
"""Files whose private names are fenced by their own checks (embedlens/compat/ is fenced too)."""


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


def test_no_private_name_of_another_library_outside_the_fenced_files():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    found = [
        f"{path.relative_to(root)}:{line}: {text}"
        for path in sorted((root / "embedlens").rglob("*.py"))
        if path.relative_to(root).as_posix() not in FENCED
        and "compat" not in path.relative_to(root).parts
        for line, text in private_names(path.read_text(encoding="utf-8"))
    ]
    assert found == []
