"""The public path gives the shortcuts' bytes: EMBEDLENS_PLAIN=1, or a shortcut's private part
gone, loads through transformers' `AutoConfig`, `AutoModelForCausalLM` and `AutoTokenizer`, and
every figure is the same.

The lens JSON of every test family (and the real SmolLM2 GGUF, and `params --meta-only`) is
compared byte for byte between the two paths; each private function the shortcuts call, removed,
closes the gate with one note and leaves the bytes as they were.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from embedlens import compat
from embedlens.compat import transformers as fence
from tests.models import FAMILIES

PLAIN = {"EMBEDLENS_PLAIN": "1"}


@pytest.fixture(autouse=True)
def _decided_anew() -> Iterator[None]:
    """Each test decides the gate itself (a removed attribute must be seen)."""
    fence.forget()
    yield
    fence.forget()


_FAST: dict[str, str] = {}


def _fast_lens(cli: Any, folder: Any) -> str:
    """The lens JSON through the shortcuts, made once per folder."""
    if str(folder) not in _FAST:
        fence.forget()
        _FAST[str(folder)] = _lens(cli, folder)[0]
        assert fence.fast()
        fence.forget()
    return _FAST[str(folder)]


def _lens(cli: Any, folder: Any, env: dict[str, str] | None = None) -> tuple[str, str]:
    result = cli("lens", folder, "the capital of France is", "--json", env=env)
    assert result.exit_code == 0, result.stderr
    return result.stdout, result.stderr


@pytest.mark.skipif(not fence.release_fits(), reason="the shortcuts are closed on this release")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_lens_json_is_the_same_on_the_public_path(cli, tiny, family, monkeypatch):
    folder = tiny(family)
    fast, _ = _lens(cli, folder)
    assert fence.fast() and fence.fast("tokenizer")
    seen: list[str] = []
    monkeypatch.setattr(fence, "say_once", seen.append)
    plain, stderr = _lens(cli, folder, PLAIN)
    assert plain == fast
    assert "note:" not in stderr and not seen  # asked for: no note


def test_the_gguf_lens_is_the_same_on_the_public_path(cli, smollm2):
    fast, _ = _lens(cli, smollm2)
    plain, _ = _lens(cli, smollm2, PLAIN)
    assert plain == fast


@pytest.mark.parametrize("family", ["llama-tied", "llama-untied", "gemma2"])
def test_params_meta_only_is_the_same_on_the_public_path(cli, tiny, family):
    folder = tiny(family)
    fast = cli("params", folder, "--meta-only", "--json")
    plain = cli("params", folder, "--meta-only", "--json", env=PLAIN)
    assert fast.exit_code == plain.exit_code == 0
    assert plain.stdout == fast.stdout


def _stand_in(raw: Any) -> Any:
    """`raw` (a function, method or class) behind a signature of (*args, **kwargs): it does what
    it did for transformers' own calls, and is no longer what the shortcuts were written for."""
    if isinstance(raw, classmethod):
        inner = raw.__func__
        return classmethod(lambda cls, *args, **kwargs: inner(cls, *args, **kwargs))
    if isinstance(raw, staticmethod):
        inner = raw.__func__
        return staticmethod(lambda *args, **kwargs: inner(*args, **kwargs))
    if isinstance(raw, type):

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            raw.__init__(self, *args, **kwargs)

        return type(raw.__name__, (raw,), {"__init__": __init__, "__signature__": None})
    return lambda *args, **kwargs: raw(*args, **kwargs)


@pytest.mark.skipif(not fence.release_fits(), reason="the shortcuts are closed on this release")
@pytest.mark.parametrize("where", [*fence.FAST_SIGNATURES, *fence.FAST_KEYWORDS])
def test_a_private_function_changed_takes_the_public_path(cli, tiny, where, monkeypatch):
    """Each private function the shortcuts call, given another signature: one note naming it,
    the public path, the same bytes."""
    import importlib

    folder = tiny("llama-tied")
    before = _fast_lens(cli, folder)
    module_name, _, qualname = where.partition(":")
    holder: Any = importlib.import_module(module_name)
    *owners, name = qualname.split(".")
    for owner in owners:
        holder = getattr(holder, owner)
    raw = vars(holder)[name] if isinstance(holder, type) else getattr(holder, name)
    monkeypatch.setattr(holder, name, _stand_in(raw))
    fence.forget()  # decided again, with the stand-in
    assert not fence.signature_starts(where, ("no such parameter",))
    notes: list[str] = []
    monkeypatch.setattr("embedlens.compat.transformers.say_once", notes.append)
    after, _ = _lens(cli, folder)
    assert after == before
    assert not fence.fast()
    assert len(notes) == 1 and name in notes[0], notes


def test_another_release_takes_the_public_path_with_one_note(cli, tiny, monkeypatch):
    folder = tiny("qwen3")
    expected, _ = _lens(cli, folder, PLAIN)
    real = compat.release
    monkeypatch.setattr(compat, "release", lambda d: (5, 0, 0) if d == "transformers" else real(d))
    fence.forget()
    result = cli("lens", folder, "the capital of France is", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == expected
    notes = [line for line in result.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1, result.stderr
    assert "public API" in notes[0] and "5.24.x and 5.25.x only (CI tests 5.0 to" in notes[0]


def test_the_gate_reads_releases_as_numbers(monkeypatch):
    monkeypatch.delenv(compat.PLAIN_ENV, raising=False)
    real = compat.release
    for found, fits in [
        ((5, 24, 0), True), ((5, 24, 3), True), ((5, 25, 0), True), ((5, 26, 0), False),
        ((5, 0, 0), False),
        ((6, 0), False), (None, False),
    ]:  # fmt: skip
        monkeypatch.setattr(
            compat, "release", lambda d, f=found: f if d == "transformers" else real(d)
        )
        assert fence.release_fits() is fits, found
    assert fence.signature_starts("json:dumps", ("obj",))
    assert not fence.signature_starts("json:dumps", ("object",))
    assert not fence.signature_starts("json:no_such_function", ())
    assert fence.takes("json:dumps", ("indent", "sort_keys"))
    assert not fence.takes("json:dumps", ("width",))
