"""The prompt is the file's tokens: on a GGUF model, the ids the lens's tokenizer gives every text
it runs (the prompt, a chat-rendered prompt, --target, each line of --prompts, and with --against
B's file too) are checked against the file's own tokenizer and its add_bos_token/add_eos_token
before the forward pass; a difference refuses the run with both id lists and the transformers
release that reads the file right."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import embedlens
from embedlens.compat.transformers import NEWEST_TESTED as TESTED_TRANSFORMERS
from embedlens.compat.transformers import installed_transformers, release_key
from embedlens.errors import UnsupportedError
from embedlens.model import file_tokens
from tests.conftest import READS_GGUF_AS_FILE
from tests.tiny_gguf import byte_level_vocabulary, gemma_vocabulary, write_tiny_gguf

PROMPT = "The capital of France is"
OLDER = release_key(installed_transformers() or "0") < READS_GGUF_AS_FILE
"""Whether this transformers reads GGUF tokenizers otherwise than their files (CI's
lowest-releases run)."""
OLD_PYTHON = os.environ.get("EMBEDLENS_OLD_TRANSFORMERS_PYTHON") or (
    sys.executable if OLDER else ""
)
"""An interpreter whose transformers is older than the newest tested (5.0.0 reads SmolLM2's GGUF
with '<|im_start|>' in front of every prompt): this one on CI's lowest releases, or the one
EMBEDLENS_OLD_TRANSFORMERS_PYTHON names."""
newest_only = pytest.mark.skipif(
    OLDER, reason="this transformers reads the tiny files otherwise: they are refused"
)


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny GGUF models: Gemma 3's shape (SentencePiece, BOS added) and SmolLM2's (byte-level
    BPE, no BOS), and the latter again with add_bos_token set."""
    folder = tmp_path_factory.mktemp("prompt-tokens")
    byte_level = byte_level_vocabulary()
    bos = byte_level_vocabulary()
    bos.flags["add_bos_token"] = True
    return {
        "gemma": write_tiny_gguf(folder / "gemma3.gguf", "gemma3", gemma_vocabulary()),
        "smol": write_tiny_gguf(folder / "smol.gguf", "llama", byte_level),
        "smol-bos": write_tiny_gguf(folder / "smol-bos.gguf", "llama", bos),
    }


@pytest.fixture
def no_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading any weight fails the test: a refusal must come before the forward pass."""
    from embedlens.model import loading

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loading, "load_model", refused)


def _transformers_reads(monkeypatch: pytest.MonkeyPatch, change: Callable[[Any], None]) -> None:
    """Every tokenizer transformers builds is changed by `change` (as an older release reads a
    GGUF file otherwise); a cache of its own, so no tokenizer kept by an earlier test
    (model/gguf_cache) stands in for the one transformers builds."""
    import tempfile

    from transformers import AutoTokenizer

    monkeypatch.setenv("EMBEDLENS_CACHE", tempfile.mkdtemp(prefix="embedlens-cache-"))
    real = AutoTokenizer.from_pretrained

    def built(*args: Any, **kwargs: Any) -> Any:
        tok = real(*args, **kwargs)
        change(tok)
        return tok

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", built)


def _no_bos_and_no_merges(tok: Any) -> None:
    """What transformers 5.0.0 does to Gemma 3's GGUF: no '<bos>', words cut into pieces."""
    from tokenizers import models, processors

    backend = tok.backend_tokenizer
    backend.post_processor = processors.TemplateProcessing(single="$A", special_tokens=[])
    model = json.loads(backend.to_str())["model"]
    backend.model = models.BPE(
        vocab=model["vocab"], merges=[], unk_token=model["unk_token"], byte_fallback=True
    )


def _im_start_first(tok: Any) -> None:
    """What transformers 5.0.0 does to SmolLM2's GGUF: '<|im_start|>' (id 1) before the text."""
    from tokenizers import processors

    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )


def _misreads(text: str) -> Callable[[Any], None]:
    """A change that reads `text` alone (however asked) with one more id, 0, at its end."""

    def change(tok: Any) -> None:
        base = type(tok)

        class Misreading(base):  # type: ignore[valid-type,misc]
            def __call__(self, given: Any, *args: Any, **kwargs: Any) -> Any:
                out = base.__call__(self, given, *args, **kwargs)
                if given == text:
                    out["input_ids"] = [*out["input_ids"], 0]
                return out

        tok.__class__ = Misreading

    return change


def _file_ids(path: Path, text: str, add_special_tokens: bool = True) -> list[int]:
    return file_tokens.FileTokens(path, path.name).ids(text, add_special_tokens)


def _transformers_ids(path: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return list(tok(text)["input_ids"])


@newest_only
def test_the_tiny_files_are_read_alike_by_transformers_and_run(ggufs):
    """The control: unchanged, the newest transformers reads both tiny files as they say
    (Gemma's with its '<bos>', SmolLM2's without), and the lens runs on those ids."""
    for name, first in (("gemma", [2]), ("smol", [])):
        path = ggufs[name]
        want = _file_ids(path, PROMPT)
        assert want[: len(first)] == first and want[len(first) :] == _file_ids(path, PROMPT, False)
        assert _transformers_ids(path, PROMPT) == want, name
        report = embedlens.lens(path, PROMPT, target=" France" if name == "smol" else None)
        assert [t.id for t in report.tokens] == want and report.check.ok


@newest_only
@pytest.mark.parametrize(
    ("name", "change", "first"),
    [("gemma", _no_bos_and_no_merges, 1), ("smol", _im_start_first, 0)],
    ids=["sentencepiece", "byte-level"],
)
def test_a_file_transformers_reads_otherwise_is_refused_with_both_lists(
    ggufs, monkeypatch, no_load, cli, name, change, first
):
    """Gemma 3's shape read without '<bos>' and cut into pieces, SmolLM2's with '<|im_start|>'
    in front: refused before the model loads, with both id lists, the release installed and
    the newest tested; the command line says it in one error line (exit 1) and a hint."""
    path = ggufs[name]
    want = _file_ids(path, PROMPT)
    _transformers_reads(monkeypatch, change)
    monkeypatch.setattr(file_tokens, "installed_transformers", lambda: "5.0.0")
    got = _transformers_ids(path, PROMPT)
    assert got != want and got[first] != want[first]
    with pytest.raises(UnsupportedError) as refused:
        embedlens.lens(path, PROMPT)
    message = refused.value.message
    assert message.startswith(f"transformers 5.0.0 reads '{PROMPT}' as {str(got[:16])[:-1]}")
    assert f"'{path.name}' itself reads {str(want[:16])[:-1]}" in message
    assert message.endswith(
        f"transformers {TESTED_TRANSFORMERS}, the newest release tested, reads this file as it says"
    )
    stderr = cli.fails("lens", path, PROMPT, code=1)
    assert stderr.splitlines() == [
        "error: " + message,
        f"hint: pip install 'transformers=={TESTED_TRANSFORMERS}', and run again",
    ]


@newest_only
def test_the_whole_lists_show_where_they_part(ggufs, monkeypatch, no_load):
    """A long prompt: each list shows the ids around the first difference, says how many it
    leaves out, and the two counts."""
    path = ggufs["smol"]
    prompt = " ".join(["The king and the queen live in the capital city."] * 8)
    want = _file_ids(path, prompt)
    assert len(want) > 40
    _transformers_reads(monkeypatch, _misreads(prompt))
    with pytest.raises(UnsupportedError) as refused:
        embedlens.lens(path, prompt)
    message = refused.value.message
    at = len(want)  # the misreading adds one id at the end
    assert f"({len(want) + 1} ids against {len(want)}, the first difference at position {at})" in (
        message
    )
    assert ", ".join(map(str, [*want[-5:], 0])) + "]" in message  # the difference is shown
    assert f"…{len(want) + 1 - 16} before" in message and "more…" not in message
    assert "…" in message.split("'")[1]  # the prompt is cut too


@newest_only
@pytest.mark.parametrize("what", ["target", "chat", "line"])
def test_every_text_the_lens_runs_is_checked(ggufs, monkeypatch, no_load, tmp_path, what):
    """--target, a chat-rendered prompt and one line of --prompts read otherwise are refused
    the same way, before the model loads."""
    path = ggufs["smol"]
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The king and the queen\nThe capital of Italy is\n", encoding="utf-8")
    misread = {
        "target": " France",
        "chat": "<|im_start|>Where is Paris?<|im_end|>" + PROMPT,
        "line": "The capital of Italy is",
    }[what]
    _transformers_reads(monkeypatch, _misreads(misread))
    with pytest.raises(UnsupportedError, match=r"reads '.*' as \[") as refused:
        if what == "target":
            embedlens.lens(path, PROMPT, target=misread)
        elif what == "chat":
            embedlens.lens(path, PROMPT, chat="Where is Paris?", chat_template=template)
        else:
            embedlens.lens_prompts(path, prompts.read_text().splitlines(), skip_bad=True)
    assert str(_file_ids(path, misread, what == "line"))[1:-1] in refused.value.message


@newest_only
def test_b_s_gguf_must_read_the_ids_a_gives(ggufs, no_load, cli):
    """--against B: B runs on A's ids, so a B whose file adds a BOS that A's does not is
    refused, saying which file reads what."""
    a, b = ggufs["smol"], ggufs["smol-bos"]
    for run in (
        lambda: embedlens.lens(a, PROMPT, against=b),
        lambda: embedlens.lens_prompts(a, [PROMPT, "The king"], against=b),
    ):
        with pytest.raises(UnsupportedError) as refused:
            run()
        ids = _file_ids(a, PROMPT)
        assert refused.value.message == (
            f"'{b.name}' reads '{PROMPT}' as {[1, *ids]}, where the tokenizer of '{a}' gives "
            f"{ids} ({len(ids) + 1} ids against {len(ids)}, the first difference at position 0)"
        )
    stderr = cli.fails("lens", a, PROMPT, "--against", b, code=1)
    assert f"'{b.name}' reads" in stderr


def test_a_tokenizer_given_is_checked_against_the_file(ggufs, no_load):
    """A tokenizer passed in Python that reads the prompt otherwise than the file: refused,
    naming it as the one given."""
    from transformers import AutoTokenizer

    path = ggufs["smol"]
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    _im_start_first(tok)
    with pytest.raises(UnsupportedError, match=r"^the tokenizer given reads ") as refused:
        embedlens.lens(path, PROMPT, tokenizer=tok)
    assert refused.value.hint == "leave the tokenizer out to read the prompt as the file does"


@newest_only
def test_a_tokenizer_given_for_a_vocabulary_embedlens_does_not_rebuild_runs(ggufs, tmp_path):
    """A file whose kind of tokenizer embedlens does not rebuild: with a tokenizer given, the
    lens runs as it did (nothing to check it against); without one it is refused, as before."""
    from transformers import AutoTokenizer

    vocab = byte_level_vocabulary()
    vocab.model = "rwkv"
    path = write_tiny_gguf(tmp_path / "rwkv.gguf", "llama", vocab)
    smol = ggufs["smol"]
    tok = AutoTokenizer.from_pretrained(str(smol.parent), gguf_file=smol.name)
    report = embedlens.lens(path, PROMPT, tokenizer=tok)
    assert [t.id for t in report.tokens] == _file_ids(smol, PROMPT) and report.check.ok
    with pytest.raises(UnsupportedError, match="has a 'rwkv' tokenizer"):
        embedlens.lens(path, PROMPT)


@pytest.mark.parametrize("installed", ["5.0.0", TESTED_TRANSFORMERS, "99.0.0"])
def test_which_release_reads_the_file_right(ggufs, monkeypatch, no_load, installed):
    """Older or newer than the newest tested: that one reads it right; the newest tested
    itself: no release is known to."""
    monkeypatch.setattr(file_tokens, "installed_transformers", lambda: installed)
    _transformers_reads(monkeypatch, _im_start_first)
    with pytest.raises(UnsupportedError) as refused:
        embedlens.lens(ggufs["smol"], PROMPT)
    message, hint = refused.value.message, str(refused.value.hint)
    assert message.startswith(f"transformers {installed} reads ")
    if installed == TESTED_TRANSFORMERS:
        assert message.endswith("no release is known to read this file as it says")
        assert hint.startswith("report it")
    else:
        assert message.endswith(
            f"transformers {TESTED_TRANSFORMERS}, the newest release tested, reads this file as "
            "it says"
        )
        assert hint == f"pip install 'transformers=={TESTED_TRANSFORMERS}', and run again"


def test_what_the_file_puts_around_a_text(tmp_path):
    """BOS when add_bos_token says so, and for a SentencePiece file that does not say; EOS
    when add_eos_token does; nothing without special tokens."""
    cases = [
        ("llama", {}, [2], []),
        ("llama", {"add_bos_token": False}, [], []),
        ("llama", {"add_bos_token": True, "add_eos_token": True}, [2], [1]),
        ("gpt2", {}, [], []),
        ("gpt2", {"add_bos_token": True}, [1], []),
    ]
    for i, (kind, flags, first, last) in enumerate(cases):
        vocab = gemma_vocabulary() if kind == "llama" else byte_level_vocabulary()
        vocab.flags = {k: v for k, v in vocab.flags.items() if k == "add_space_prefix"} | flags
        path = write_tiny_gguf(tmp_path / f"{i}.gguf", "llama", vocab)
        body = _file_ids(path, "the king", False)
        assert _file_ids(path, "the king") == [*first, *body, *last], (kind, flags)
        assert body and body[0] not in first


def test_smollm2_passes_the_check_and_its_output_is_unchanged(smollm2, cli, monkeypatch):
    """The real SmolLM2 GGUF with the newest transformers: every text is checked and agrees
    (no BOS: its file says add_bos_token false), and the JSON is byte for byte the run's
    without the check."""
    if OLDER:
        pytest.skip(f"transformers {installed_transformers()} is older than the newest tested")
    checked: list[tuple[str, list[int]]] = []
    real = file_tokens.Guard.check

    def counted(self: Any, text: str, add_special_tokens: bool, ids: list[int]) -> None:
        checked.append((text, ids))
        real(self, text, add_special_tokens, ids)

    args = ("lens", smollm2, PROMPT, "--target", " Paris", "--json")
    monkeypatch.setattr(file_tokens.Guard, "check", counted)
    with_check = cli(*args)
    assert with_check.exit_code == 0, with_check.stderr
    assert checked[0] == (PROMPT, [504, 3575, 282, 4649, 314]) and len(checked) >= 2
    monkeypatch.setattr(file_tokens, "guard_for", lambda *a, **k: None)
    without = cli(*args)
    assert without.exit_code == 0 and with_check.stdout == without.stdout


def _old_python() -> str:
    """OLD_PYTHON when it can run the lens on a GGUF with a transformers older than the newest
    tested; else the test is skipped, saying why."""
    if not OLD_PYTHON or not Path(OLD_PYTHON).is_file():
        pytest.skip("no interpreter with an older transformers (EMBEDLENS_OLD_TRANSFORMERS_PYTHON)")
    probe = "import transformers, gguf; print(transformers.__version__)"
    found = subprocess.run([OLD_PYTHON, "-c", probe], capture_output=True, text=True, timeout=300)
    if found.returncode != 0:
        why = (found.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"{OLD_PYTHON} cannot read GGUF files: {why}")
    version = found.stdout.strip()
    if release_key(version) >= release_key(TESTED_TRANSFORMERS):
        pytest.skip(f"{OLD_PYTHON} has transformers {version}, not older than the newest tested")
    return version


_IDS = """
import sys
from transformers import AutoTokenizer
path = sys.argv[1]
folder, name = path.rsplit("/", 1)
print(list(AutoTokenizer.from_pretrained(folder, gguf_file=name)(sys.argv[2])["input_ids"]))
"""


def test_an_older_transformers_reads_smollm2_right_or_is_refused(smollm2):
    """With an older transformers the lens runs where that release gives SmolLM2's prompt the
    file's own ids, and is refused in one error line naming that release and the newest tested
    where it does not (5.0.0 puts '<|im_start|>' in front)."""
    version = _old_python()
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1"}
    probe = subprocess.run(
        [OLD_PYTHON, "-c", _IDS, str(smollm2), PROMPT], capture_output=True, text=True, env=env,
        timeout=600,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    ids = json.loads(probe.stdout.strip().splitlines()[-1])
    result = subprocess.run(
        [OLD_PYTHON, "-m", "embedlens", "lens", str(smollm2), PROMPT, "--json"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    if ids == [504, 3575, 282, 4649, 314]:  # read as the file says: the lens runs
        assert result.returncode == 0, result.stderr
        assert [t["id"] for t in json.loads(result.stdout)["tokens"]] == ids
        return
    lines = [
        line for line in result.stderr.splitlines() if not line.startswith(("Running", "note: "))
    ]
    assert (result.returncode, result.stdout) == (1, ""), result.stderr
    assert lines[0].startswith(f"error: transformers {version} reads '{PROMPT}' as {ids}"[:-1])
    assert "itself reads [504, 3575, 282, 4649, 314]" in lines[0]
    assert f"transformers {TESTED_TRANSFORMERS}, the newest release tested" in lines[0]
    assert len(lines) == 2 and lines[1].startswith("hint: ")
    assert "Traceback" not in result.stderr


def _every_text_misread(tok: Any) -> None:
    """Every text read with one more id, 0, at its end (however asked)."""
    base = type(tok)

    class Misreading(base):  # type: ignore[valid-type,misc]
        def __call__(self, given: Any, *args: Any, **kwargs: Any) -> Any:
            out = base.__call__(self, given, *args, **kwargs)
            out["input_ids"] = [*out["input_ids"], 0]
            return out

    tok.__class__ = Misreading


@newest_only
def test_tune_checks_its_first_texts_against_the_file(ggufs, monkeypatch, no_load, tmp_path):
    """tune on a GGUF whose transformers reading differs from the file's own is refused before
    any weight is read, as the lens is."""
    data = tmp_path / "data.txt"
    data.write_text("The king and the queen live in the capital city.\n" * 64, encoding="utf-8")
    _transformers_reads(monkeypatch, _every_text_misread)
    monkeypatch.setattr(file_tokens, "installed_transformers", lambda: "5.0.0")
    with pytest.raises(UnsupportedError) as refused:
        embedlens.tune(ggufs["smol"], data=data, out=tmp_path / "out", tokens=256, eval_tokens=64)
    assert refused.value.message.startswith("transformers 5.0.0 reads 'The king and the queen")


@newest_only
def test_lens_text_checks_its_first_lines_against_the_file(ggufs, monkeypatch, no_load, tmp_path):
    """lens --text on a GGUF whose transformers reading differs from the file's own is refused
    before any weight is read, as the lens on a prompt and tune are (it ran, with other
    figures, before)."""
    text = tmp_path / "text.txt"
    text.write_text("The king and the queen live in the capital city.\n" * 64, encoding="utf-8")
    _transformers_reads(monkeypatch, _every_text_misread)
    monkeypatch.setattr(file_tokens, "installed_transformers", lambda: "5.0.0")
    with pytest.raises(UnsupportedError) as refused:
        embedlens.lens_text(ggufs["smol"], text, ctx=16)
    assert refused.value.message.startswith("transformers 5.0.0 reads 'The king and the queen")
