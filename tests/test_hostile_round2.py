"""Hostile inputs, second round: GGUF files under other names, integer weights no config explains,
chat templates that raise or compute huge values in one C call, and a closed stdout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from embedlens.errors import SourceError
from embedlens.io.source import resolve
from tests.badinputs import INTEGER_NUMPY, config_chat_template, st_as_integer
from tests.fileformats import gguf_bytes

# --- GGUF files not named .gguf ---------------------------------------------------------------


def test_a_gguf_file_is_known_by_its_magic_not_its_name(tmp_path):
    blob = tmp_path / "3f2a9c0d1e"  # a hub cache blob is named by its hash
    blob.write_bytes(gguf_bytes([], [("w", (32,), 0)]))
    source = resolve(str(blob))
    assert source.kind == "gguf" and source.path == blob.resolve()
    other = tmp_path / "model.bin"
    other.write_bytes(b"PK\x03\x04 not a GGUF file")
    with pytest.raises(SourceError, match="is a file but not a model"):
        resolve(str(other))


def test_transformers_gets_a_gguf_name_and_the_file_is_left_alone(tmp_path):
    from embedlens.model.loading import _gguf_named

    blob = tmp_path / "model.bin"
    blob.write_bytes(gguf_bytes([], [("w", (32,), 0)]))
    before = blob.read_bytes()
    with _gguf_named(blob) as named:
        assert named.name.endswith(".gguf") and named.resolve() == blob.resolve()
        assert named.read_bytes() == before
    assert not named.exists() and not named.parent.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.bin"]
    assert blob.read_bytes() == before
    gguf = tmp_path / "real.gguf"
    gguf.write_bytes(before)
    with _gguf_named(gguf) as named:
        assert named == gguf


@pytest.fixture(scope="module")
def smol_as_bin(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the SmolLM2 GGUF saved as model.bin (a copy: resolve() follows links)."""
    path = tmp_path_factory.mktemp("renamed") / "model.bin"
    shutil.copyfile(smollm2, path)
    return path


EVERY_COMMAND = [
    ["params"],
    ["params", "--load"],
    ["tied"],
    ["vocab"],
    ["neighbors", " king", "-k", "5"],
    ["addr", " cat"],
    ["lens", "The capital of France is"],
    ["lens", "The capital of France is", "--dtype", "auto"],  # transformers' suffix check
]


def _named(data: dict[str, Any], model: Path) -> str:
    """The JSON with the model's path and file name replaced by one placeholder."""
    text = json.dumps(data, sort_keys=True)
    return text.replace(str(model), "MODEL").replace(json.dumps(model.name), '"MODEL"')


@pytest.mark.parametrize("args", EVERY_COMMAND, ids=lambda a: "-".join(a[:1] + a[-1:]))
def test_every_command_reads_a_gguf_saved_as_model_bin(cli, smollm2, smol_as_bin, args):
    renamed = cli.json(args[0], smol_as_bin, *args[1:])
    original = cli.json(args[0], smollm2, *args[1:])
    assert _named(renamed, smol_as_bin) == _named(original, smollm2)
    assert list(smol_as_bin.parent.iterdir()) == [smol_as_bin]


# --- integer weights no quantization_config explains ------------------------------------------


def _integer_copy(tmp_path: Path, tiny: Any, name: str, dtype: str) -> Path:
    folder = tmp_path / f"{dtype}-model"
    shutil.copytree(tiny("llama-tied"), folder)
    st_as_integer(folder, name, dtype)
    return folder


EMBEDDING = "model.embed_tokens.weight"


@pytest.mark.parametrize("dtype", sorted(INTEGER_NUMPY))
def test_an_integer_embedding_is_refused_not_read_as_values(cli, tiny, tmp_path, dtype):
    model = _integer_copy(tmp_path, tiny, EMBEDDING, dtype)
    said = (
        f"error: {EMBEDDING} is stored as {dtype}, an integer type, and config.json has no "
        "quantization_config to say how to read it"
    )
    for args in (["neighbors", model, "king"], ["vocab", model], ["lens", model, "the king"]):
        assert cli.fails(*args, code=1).splitlines()[0] == said, args
    # the headers alone, and the layout of the stored bytes, are still what is stored
    assert cli.json("params", model)["total"] == cli.json("params", tiny("llama-tied"))["total"]
    assert cli.json("addr", model, "3")["element_size"] == INTEGER_BYTES[dtype]


INTEGER_BYTES = {"I8": 1, "I16": 2, "I32": 4, "I64": 8, "U8": 1, "BOOL": 1}


def test_an_integer_weight_inside_a_block_stops_the_load(cli, tiny, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"
    model = _integer_copy(tmp_path, tiny, name, "I8")
    for args in (
        ["lens", model, "the king"],
        ["params", model, "--load"],
        ["tied", model, "--load"],
    ):
        err = cli.fails(*args, code=1)
        assert err.startswith(f"error: {name} is stored as I8, an integer type"), (args, err)
    # neighbors reads the embedding alone, which is float32
    assert cli.json("neighbors", model, "king", "-k", "3")["queries"][0]["neighbors"]


def test_a_quantization_config_explains_integer_weights(cli, tiny, tmp_path):
    model = _integer_copy(tmp_path, tiny, EMBEDDING, "I8")
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    (model / "config.json").write_text(json.dumps(config))
    err = cli.fails("neighbors", model, "king", code=1)
    assert "no quantization_config" not in err
    assert f"'{EMBEDDING}' is stored as I8; embedlens reads F32, F16, BF16 and F64" in err


# --- a model's chat template that raises ------------------------------------------------------

RAISES = "{{ raise_exception('This model only takes a system message first') }}"


def test_a_models_template_that_raises_is_the_models_fault(cli, tiny, tmp_path):
    model = config_chat_template(tmp_path, tiny, RAISES)
    err = cli.fails("lens", model, "Paris", "--chat", "hello", code=1)
    line = err.splitlines()[0]
    assert line == (
        f"error: the chat template in '{model / 'tokenizer_config.json'}' fails: This model only "
        "takes a system message first"
    ), err
    # the same template given with --chat-template is the user's to fix: a usage error
    given = tmp_path / "raises.jinja"
    given.write_text(RAISES)
    err = cli.fails(
        "lens", tiny("llama-tied"), "Paris", "--chat", "hi", "--chat-template", given, code=2
    )
    assert "This model only takes a system message first" in err


# --- C-level template operations, refused before they run ------------------------------------

HUGE = 10**10
"""Characters (or elements) each template below would build in one C call, where no timer
interrupts it: 10 GB and more."""
C_LEVEL = {
    "repeat": f"{{{{ 'x' * {HUGE} }}}}",
    "ljust": f"{{{{ 'x'.ljust({HUGE}) }}}}",
    "center-filter": f"{{{{ 'x'|center({HUGE}) }}}}",
    "indent-filter": f"{{{{ 'a\\nb'|indent({HUGE}) }}}}",
    "printf-star": f"{{{{ '%*s' % ({HUGE}, 'x') }}}}",
    "format-filter": f"{{{{ '%{HUGE}d'|format(1) }}}}",
    "str-format-width": f"{{{{ '{{:>{HUGE}}}'.format('x') }}}}",
    "str-format-nested": f"{{{{ '{{0:.{{1}}f}}'.format(1.5, {HUGE}) }}}}",
    "tojson-indent": f"{{{{ messages|tojson(indent={HUGE}) }}}}",
    "str-join": "{{ ('y' * 4000).join('x' * 4000) }}",
    "replace-empty": "{{ ('x' * 4000)|replace('', 'y' * 4000) }}",
    "to-bytes": f"{{{{ (1).to_bytes({HUGE}, 'big') }}}}",
    "batch-fill": f"{{{{ [0]|batch({HUGE}, 0)|list }}}}",
    "tilde-doubling": "{% set ns = namespace(s='x' * 4000) %}"
    "{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "plus-doubling": "{% set ns = namespace(s='x' * 4000) %}"
    "{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
    "shared-lists-written": "{% set a = [[0] * 4000] * 4000 %}{% set b = [a, a, a, a] %}"
    "{{ [b, b, b, b] }}",
    "sum-of-lists": "{{ ([[0] * 4000] * 4000)|sum(start=[])|length }}",
}


@pytest.mark.parametrize("template", list(C_LEVEL.values()), ids=list(C_LEVEL))
def test_a_c_level_operation_is_refused_before_it_runs(cli, tiny, tmp_path, template):
    """Refused by its size before it runs, not by the timer after (how long it takes belongs to
    the bench: no test may need a quiet machine)."""
    model = config_chat_template(tmp_path, tiny, template)
    err = cli.fails("lens", model, "Paris", "--chat", "hello", code=1)
    line = err.splitlines()[0]
    assert line.startswith(f"error: the chat template in '{model / 'tokenizer_config.json'}' ")
    assert " computes a value of about " in line and "more than the 4,096 " in line, line


def test_the_checks_leave_a_working_template_as_it_was(cli, tiny, tmp_path):
    template = (
        "{% set tools = [{'name': 'f', 'parameters': {'type': 'object'}}] %}"
        "{{ tools|tojson(indent=2) }}{{ '%s-%d' % ('a', 3) }}{{ '{}:{:>4}'.format('a', 'b') }}"
        "{{ 'x'|center(5) }}{{ 'a\\nb'|indent(2) }}{{ ['p', 'q']|join(', ') }}"
        "{% for m in messages %}<s> {{ m['role'] ~ ' ' + m['content'] }} </s> {% endfor %}"
        "{% if add_generation_prompt %}<s> {% endif %}"
    )
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    messages = [{"role": "user", "content": "hello"}]
    expected = ImmutableSandboxedEnvironment().from_string(template)
    text = expected.render(messages=messages, add_generation_prompt=True) + "Paris"
    model = config_chat_template(tmp_path, tiny, template)
    assert cli.json("lens", model, "Paris", "--chat", "hello")["prompt"] == text


def test_a_template_compiled_under_one_bound_keeps_none_of_its_own():
    """transformers keeps a compiled template: its checked filters and `~` follow the bound of
    the render under way, and outside any render run as Jinja's own."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from embedlens.errors import ConfigError
    from embedlens.model import chat

    compiled: list[Any] = []

    def compile_and_render() -> str:
        env = ImmutableSandboxedEnvironment()
        compiled.append(env.from_string("{{ 'z'|center(n) ~ ('y' * n) }}"))
        return str(compiled[0].render(n=3))

    assert chat.render(compile_and_render, limit=100, what="t") == " z yyy"
    template = compiled[0]
    with pytest.raises(ConfigError, match="about 5,000 characters with the center filter"):
        chat.render(lambda: template.render(n=5000), limit=4096, what="t")
    assert len(chat.render(lambda: template.render(n=5000), limit=20000, what="t")) == 10000
    assert len(template.render(n=5000)) == 10000


# --- help and version on a closed stdout ------------------------------------------------------

_SLOW = pytest.mark.slow
HELP_ARGS = [
    pytest.param(["--help"], id="top"),
    pytest.param(["params", "--help"], id="params"),
    *(
        pytest.param([command, "--help"], id=command, marks=_SLOW)
        for command in ("tied", "neighbors", "addr", "lens", "vocab")
    ),
    pytest.param(["-h"], id="top-short", marks=_SLOW),
    pytest.param(["lens", "-h"], id="lens-short", marks=_SLOW),
    pytest.param(["--version"], id="version", marks=_SLOW),
]


@pytest.mark.parametrize("argv", HELP_ARGS)
def test_help_on_a_closed_stdout_is_an_error(argv):
    """`embedlens params --help >&-`: the help cannot be written, so the command fails as the
    commands' own output does (Click's echo would skip it and exit 0)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "EMBEDLENS_DEBUG"}
    result = subprocess.run(
        ["bash", "-c", '"$0" -m embedlens "$@" >&-', sys.executable, *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1, result
    assert result.stderr.splitlines() == [
        "error: cannot write the output: stdout is closed",
        "hint: stdout was closed (>&-): send it to a file, a pipe or /dev/null instead",
    ], result.stderr
