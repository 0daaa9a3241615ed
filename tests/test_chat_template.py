"""`lens --chat`: a model without a chat template fails before it loads, and `--chat-template FILE`
(or `chat_template=` in Python) gives one, still rendered within bounds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import embedlens
from embedlens.errors import UsageError
from tests.badinputs import _gguf_rewrite
from tests.test_lens_prompts import close

TEMPLATE = (
    "{% for m in messages %}<s> {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> {% endif %}"
)
"""The template the tiny models ship (tests/models.py)."""


@pytest.fixture
def no_load(monkeypatch) -> list[Any]:
    """Record every call of the function that loads a model's weights (none is expected)."""
    from embedlens.model import loading

    calls: list[Any] = []
    original = loading.load_model

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(loading, "load_model", recording)
    return calls


@pytest.fixture
def bare(tiny, tmp_path) -> Path:
    """The tiny Llama without a chat template, as a base model is."""
    folder = tmp_path / "base"
    shutil.copytree(tiny("llama-tied"), folder)
    (folder / "chat_template.jinja").unlink()
    return folder


def test_no_template_fails_before_the_model_loads(cli, bare, no_load):
    err = cli.fails("lens", bare, "Paris", "--chat", "hello", code=2)
    assert "no chat template" in err and "--chat-template FILE" in err
    assert no_load == []


def test_a_template_file_makes_chat_work(cli, tiny, bare, tmp_path, no_load):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    given = cli.json("lens", bare, "Paris", "--chat", "the capital", "--chat-template", template)
    own = cli.json("lens", tiny("llama-tied"), "Paris", "--chat", "the capital")
    assert given["tokens"] == own["tokens"]
    assert [t["token"] for t in given["tokens"]] == [
        "<s>",
        "the",
        "capital",
        "</s>",
        "<s>",
        "Paris",
    ]
    assert given["layers"] == own["layers"]
    assert len(no_load) == 2


def test_a_template_file_replaces_the_models_own(cli, tiny, tmp_path):
    template = tmp_path / "red.jinja"
    template.write_text("<s> red {{ messages[0]['content'] }} </s> <s> ")
    data = cli.json(
        "lens", tiny("llama-tied"), "Paris", "--chat", "cat", "--chat-template", template
    )
    assert [t["token"] for t in data["tokens"]] == ["<s>", "red", "cat", "</s>", "<s>", "Paris"]


def test_api_takes_the_text_or_a_path(bare, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    from_text = embedlens.lens(bare, "Paris", chat="the capital", chat_template=TEMPLATE)
    from_path = embedlens.lens(bare, "Paris", chat="the capital", chat_template=template)
    assert from_text.tokens == from_path.tokens
    assert [t.token for t in from_text.tokens][-2:] == ["<s>", "Paris"]
    with pytest.raises(UsageError, match="only applies with --chat"):
        embedlens.lens(bare, "Paris", chat_template=TEMPLATE)
    with pytest.raises(UsageError, match="no chat template"):
        embedlens.lens(bare, "Paris", chat="the capital")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read --chat-template"),
        ("folder", "is a folder"),
        (b"\xff\xfe{{ x }}", "is not UTF-8"),
        ("  \n", "is empty"),
        ("{% for m in messages %}{{ m['content'] }}", "the chat template failed"),
        ("{{ 'x' * 10**12 }}", "with '*'"),  # the bound on repeated text holds for given files
        ("{{ messages[0]['content'] * 10**9 }}", "with '*'"),
    ],
)
def test_bad_template_files(cli, bare, tmp_path, no_load, content, message):
    path = tmp_path / "bad.jinja"
    if content == "folder":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    err = cli.fails("lens", bare, "Paris", "--chat", "hi", "--chat-template", path, code=2)
    assert message in err
    assert no_load == []


def test_template_without_chat_is_a_usage_error(cli, bare, tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    err = cli.fails("lens", bare, "Paris", "--chat-template", path, code=2)
    assert "--chat-template only applies with --chat" in err


def test_gguf_without_a_template(cli, smollm2, tmp_path, no_load):
    """A GGUF file whose chat template is empty: --chat fails before the weights load, and its
    template given as a file gives what the file's own template gives."""
    from embedlens.io.gguf import read_gguf_header

    own = str(read_gguf_header(smollm2).metadata["tokenizer.chat_template"])
    bare = _gguf_rewrite(smollm2, tmp_path / "bare.gguf", meta={"tokenizer.chat_template": (8, "")})
    err = cli.fails("lens", bare, "Paris", "--chat", "The capital of France?", code=2)
    assert "no chat template" in err and no_load == []
    template = tmp_path / "smol.jinja"
    template.write_text(own)
    args = ["Paris", "--chat", "The capital of France?", "--layers", "29:", "-k", "2"]
    given = cli.json("lens", bare, *args, "--chat-template", template)
    shipped = cli.json("lens", smollm2, *args)
    assert given["tokens"] == shipped["tokens"]
    assert given["layers"] == shipped["layers"]


def test_a_template_file_serves_every_chat_line_of_a_prompts_file(cli, tiny, bare, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    lines = tmp_path / "prompts.jsonl"
    lines.write_text('{"prompt": "Paris", "chat": "the capital"}\n{"prompt": "king"}\n')
    result = cli("lens", bare, "--prompts", lines, "--chat-template", template, "--json")
    assert result.exit_code == 0, result.stderr
    first, second, summary = (json.loads(x) for x in result.stdout.splitlines())
    own = cli.json("lens", tiny("llama-tied"), "Paris", "--chat", "the capital")
    assert first["tokens"] == own["tokens"]
    close(first["layers"], own["layers"])  # batched: equal up to float32 rounding
    assert second["tokens"] == cli.json("lens", bare, "king")["tokens"]
    assert summary["summary"] is True and summary["n_prompts"] == 2
    without = cli("lens", bare, "--prompts", lines)
    assert without.exit_code == 2 and "line 1" in without.stderr
    assert "no chat template" in without.stderr


@pytest.mark.parametrize("form", ["folder", "gguf"])
def test_no_chat_template_is_said_from_the_files_before_transformers_loads(
    form, tiny, smollm2, tmp_path
):
    """--chat on a model whose files hold no chat template: refused from the files (a GGUF
    header, tokenizer_config.json) before the tokenizer is built, so before transformers or torch
    is imported (a 262k-token GGUF took 46 s to rebuild its tokenizer first)."""

    if form == "gguf":
        model = _gguf_rewrite(
            smollm2, tmp_path / "no-template.gguf", meta={"tokenizer.chat_template": (8, "")}
        )
    else:
        model = tmp_path / "no-template"
        shutil.copytree(tiny("llama-tied"), model)
        (model / "chat_template.jinja").unlink()
    result, imported, said = _imports_of("lens", model, "Paris", "--chat", "The capital of France?")
    assert (result.returncode, result.stdout) == (2, "")
    assert said[0] == "error: this model's tokenizer has no chat template, so --chat cannot be used"
    assert not imported & {"torch", "transformers"}, sorted(imported & {"torch", "transformers"})
    with pytest.raises(UsageError, match="no chat template"):  # the library says the same
        embedlens.lens(model, "Paris", chat="The capital of France?")


def test_a_bad_target_on_a_gguf_is_refused_before_transformers_loads(smollm2, tmp_path):
    """--target that is not one token of a GGUF's vocabulary: refused with embedlens' own reading
    of the file's tokenizer (the ids transformers' gives), before torch or transformers is
    imported, with the words the late check (a tokenizer given) says."""

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    for target in ("北京", "queen"):
        result, imported, said = _imports_of("lens", smollm2, "中国的首都是", "--target", target)
        assert (result.returncode, result.stdout) == (2, "")
        assert not imported & {"torch", "transformers"}, target
        with pytest.raises(UsageError) as late:
            embedlens.lens(smollm2, "中国的首都是", target=target, tokenizer=tok)
        assert said[0] == "error: " + late.value.message
        assert said[1] == "hint: " + str(late.value.hint)


def _imports_of(*argv: Any) -> tuple[Any, set[str], list[str]]:
    """Run `embedlens ARGV` with `-X importtime`: the result, every module imported, and the
    stderr lines that are not import times."""
    import os
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "embedlens", *map(str, argv)],
        capture_output=True, text=True, env=env, cwd=root, timeout=120,
    )  # fmt: skip
    lines = result.stderr.splitlines()
    imported = {line.rsplit("|", 1)[-1].strip() for line in lines if line.startswith("import ")}
    return result, imported, [line for line in lines if not line.startswith("import time:")]


def _targets_file(path: Path, bad: str, good: tuple[str, str] = (" Paris", " Rome")) -> Path:
    lines = [
        {"prompt": "The capital of France is", "target": good[0]},
        {"prompt": "The capital of Germany is"},
        {"prompt": "The capital of China is", "target": bad},
        {"prompt": "The capital of Italy is", "target": good[1]},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def test_a_bad_target_in_a_prompts_file_is_refused_from_the_gguf(tmp_path):
    """lens GGUF --prompts FILE, line 3's target not one token of the file's vocabulary:
    refused with its line number from embedlens' own reading of the tokenizer, before torch or
    transformers is imported; with --skip-bad it is left to the late check to count."""
    from embedlens.io.gguf import read_gguf_header
    from embedlens.model.tokenizer import vocab_from_gguf
    from tests.gemma_vocab import gemma_like_vocab
    from tests.test_vocab import _write_gguf

    tokens, scores, types = gemma_like_vocab(3000)
    model = _write_gguf(tmp_path / "sp.gguf", tokens, model="llama", scores=scores, types=types)
    vocab = vocab_from_gguf(read_gguf_header(model))
    assert len(vocab.encode("king")) == len(vocab.encode("queen")) == 1
    prompts = _targets_file(tmp_path / "p.jsonl", "kingqueenzz", ("king", "queen"))
    result, imported, said = _imports_of("lens", model, "--prompts", prompts)
    assert (result.returncode, result.stdout) == (2, "")
    assert said[0].startswith("error: line 3: --target 'kingqueenzz' is not a single token: ")
    assert not imported & {"torch", "transformers"}
    result, imported, _ = _imports_of("lens", model, "--prompts", prompts, "--skip-bad")
    assert "transformers" in imported  # not refused early: the run goes on to load the model


def test_a_bad_target_in_a_prompts_file_says_what_the_late_check_says(smollm2, tmp_path):
    """On SmolLM2's GGUF: the refusal before transformers loads has the words, line number and
    hint of the late check (a tokenizer given, so none is built from the file)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    for target in ("北京", "queen"):
        prompts = _targets_file(tmp_path / "p.jsonl", target)
        result, imported, said = _imports_of("lens", smollm2, "--prompts", prompts)
        assert (result.returncode, result.stdout) == (2, "")
        assert not imported & {"torch", "transformers"}, target
        with pytest.raises(UsageError) as late:
            embedlens.lens_prompts(smollm2, embedlens_source(prompts), tokenizer=tok)
        assert said[0] == "error: " + late.value.message
        assert said[1] == "hint: " + str(late.value.hint)
        assert late.value.message.startswith(f"line 3: --target '{target}'")


def embedlens_source(path: Path) -> Any:
    from embedlens.model.prompts import PromptSource

    return PromptSource.open(path)


# --- template arguments that collide with the chat call's own ------------------------------------


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("tokenize", "tokenises that itself"),
        ("add_generation_prompt", "always asks for the generation prompt"),
        ("conversation", "the --chat message"),
        ("messages", "the --chat message"),
        ("chat_template", "--chat-template FILE"),
        ("return_dict", "not a template variable"),
        ("continue_final_message", "not a template variable"),
    ],
)
def test_a_template_arg_the_call_takes_itself_is_a_usage_error(cli, tiny, no_load, name, says):
    """Refused as the options are read (exit 2, before any model file), the name and the reason
    said; the model's template is not blamed."""
    err = cli.fails(
        "lens",
        tiny("llama-tied"),
        "Paris",
        "--chat",
        "hi",
        "--template-arg",
        f"{name}=false",
        code=2,
    )
    assert f"--template-arg '{name}' cannot be given: " in err and says in err, err
    assert "template in" not in err
    assert no_load == []
    err = cli.fails(
        "lens", "no-such-folder", "--prompts", "-", "--template-arg", f"{name}=1", code=2
    )
    assert f"--template-arg '{name}' cannot be given" in err


def test_template_args_in_python_are_checked_the_same(tiny, no_load):
    folder = tiny("llama-tied")
    for args in ({"tokenize": False}, ["tokenize=false"]):
        with pytest.raises(UsageError, match="--template-arg 'tokenize' cannot be given"):
            embedlens.lens(folder, "Paris", chat="hi", template_args=args)
    with pytest.raises(UsageError, match="--template-arg 'return_dict' cannot be given"):
        embedlens.lens_prompts(folder, ["Paris"], template_args={"return_dict": True})
    with pytest.raises(UsageError, match="names variables by text"):
        embedlens.lens(folder, "Paris", chat="hi", template_args={1: True})  # type: ignore[dict-item]
    assert no_load == []
    # a variable of the template's own still reaches it
    shown = embedlens.lens(folder, "Paris", chat="hi", template_args={"flag": True})
    assert [t.token for t in shown.tokens][-2:] == ["<s>", "Paris"]


def test_every_name_the_call_takes_itself_is_reserved():
    """What the chat call passes itself, and apply_chat_template's parameters that are not
    template variables (all but tools and documents), are in the reserved names: the list follows
    the call and the installed transformers."""
    import inspect

    from transformers import PreTrainedTokenizerBase

    from embedlens.analysis.lens.opening import _render_chat
    from embedlens.analysis.lens.options import RESERVED_TEMPLATE_ARGS

    class Recording:
        chat_template = TEMPLATE

        def __init__(self) -> None:
            self.passed: dict[str, Any] = {}

        def apply_chat_template(self, conversation: Any, **kwargs: Any) -> str:
            self.passed.update(kwargs, conversation=conversation)
            return ""

    tokenizer = Recording()
    _render_chat(tokenizer, "hi", {}, "the template", None, own=TEMPLATE)
    assert set(tokenizer.passed) == {
        "conversation",
        "tokenize",
        "add_generation_prompt",
        "chat_template",
    }
    assert set(tokenizer.passed) <= set(RESERVED_TEMPLATE_ARGS)
    own = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    named = {n for n, p in own.items() if p.kind is not p.VAR_KEYWORD} - {"self"}
    assert named - {"tools", "documents"} <= set(RESERVED_TEMPLATE_ARGS)
