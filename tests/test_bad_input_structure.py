"""Bad input to `params` and `tied`: one error line, the contract's exit code, nothing written."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest

from tests.models import write_config

COMMANDS = ("params", "tied")


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.rglob("*")):
        h.update(str(f.relative_to(folder)).encode())
        if f.is_file():
            h.update(f.read_bytes())
    return h.hexdigest()


@pytest.fixture
def model_copy(tiny, tmp_path):
    def copy(family: str = "llama-untied") -> Path:
        target = tmp_path / family
        shutil.copytree(tiny(family), target)
        return target

    return copy


@pytest.mark.parametrize("command", COMMANDS)
def test_invalid_config_json(cli, model_copy, command):
    folder = model_copy()
    (folder / "config.json").write_text('{"model_type": "llama",')
    before = _digest(folder)
    err = cli.fails(command, folder, code=1)
    assert "is not valid JSON" in err
    assert _digest(folder) == before


@pytest.mark.parametrize("command", COMMANDS)
def test_truncated_safetensors(cli, model_copy, command):
    folder = model_copy()
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    err = cli.fails(command, folder, code=1)
    assert "is truncated" in err


def test_header_length_larger_than_the_file(cli, model_copy):
    folder = model_copy()
    weights = folder / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes(struct.pack("<Q", len(raw) * 10) + raw[8:])
    err = cli.fails("params", folder, code=1)
    assert "its header claims" in err


def test_header_that_is_not_json(cli, model_copy):
    folder = model_copy()
    weights = folder / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[8:12] = b"\xff\xfe{["
    weights.write_bytes(bytes(raw))
    assert "corrupt header" in cli.fails("params", folder, code=1)


def test_tiny_file(cli, model_copy):
    folder = model_copy()
    (folder / "model.safetensors").write_bytes(b"abc")
    assert "not even the 8-byte header length" in cli.fails("params", folder, code=1)


def test_missing_shard(cli, tiny, tmp_path):
    folder = tmp_path / "sharded"
    shutil.copytree(tiny("llama-untied", max_shard_size="20KB"), folder)
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    shard.unlink()
    err = cli.fails("params", folder, code=1)
    assert f"shard '{shard.name}'" in err and "missing" in err


@pytest.mark.parametrize("flag", [None, "--meta-only"])
def test_encoder_only_model(cli, tmp_path, flag):
    folder = write_config(
        tmp_path / "bert",
        {"model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": 100,
         "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
         "intermediate_size": 64},
    )  # fmt: skip
    args = ["params", folder] + ([flag] if flag else [])
    err = cli.fails(*args, code=1)
    assert "'BertForMaskedLM' is not a causal LM" in err


def test_encoder_decoder_model(cli, tmp_path):
    folder = write_config(
        tmp_path / "t5",
        {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"],
         "is_encoder_decoder": True, "vocab_size": 100, "d_model": 32},
    )  # fmt: skip
    assert "encoder-decoder" in cli.fails("tied", folder, "--meta-only", code=1)


def _remote_code_model(folder: Path, marker: Path) -> Path:
    write_config(
        folder,
        {"model_type": "evil_lm", "architectures": ["EvilForCausalLM"],
         "auto_map": {"AutoConfig": "configuration_evil.EvilConfig",
                      "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"},
         "vocab_size": 10, "hidden_size": 4, "num_hidden_layers": 1},
    )  # fmt: skip
    payload = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
    (folder / "configuration_evil.py").write_text(payload)
    (folder / "modeling_evil.py").write_text(payload)
    return folder


@pytest.mark.parametrize("flag", [None, "--meta-only", "--load"])
@pytest.mark.parametrize("command", COMMANDS)
def test_remote_code_is_refused_and_never_runs(cli, tmp_path, command, flag):
    marker = tmp_path / "marker"
    folder = _remote_code_model(tmp_path / "evil", marker)
    args = [command, folder] + ([flag] if flag else [])
    result = cli(*args)
    assert result.exit_code == 1 and result.stdout == ""
    assert "needs code from the model's repository" in result.stderr
    assert "hint: embedlens never runs a model's own code unless you pass --trust-remote-code" in (
        result.stderr
    )
    assert not marker.exists()


@pytest.mark.parametrize("command", COMMANDS)
def test_unknown_dtype_and_device(cli, tiny, command):
    err = cli.fails(command, tiny("llama-tied"), "--dtype", "float8", code=2)
    assert "Invalid value for '--dtype': 'float8' is not one of 'auto', 'float32'" in err
    err = cli.fails(command, tiny("llama-tied"), "--device", "tpu", code=2)
    assert "unknown device 'tpu'" in err


@pytest.mark.parametrize("command", COMMANDS)
def test_conflicting_flags(cli, tiny, command):
    err = cli.fails(command, tiny("llama-tied"), "--meta-only", "--load", code=2)
    assert "exclude each other" in err


def test_usage_errors_are_one_line(cli, tiny):
    err = cli.fails("params", tiny("llama-tied"), "--no-such-option", code=2)
    assert "No such option" in err and "hint: see 'embedlens params --help'" in err
    err = cli.fails("params", code=2)
    assert "Missing argument 'MODEL'" in err
    err = cli.fails("no-such-command", code=2)
    assert "No such command" in err


def test_meta_only_refused_for_gguf(cli, smollm2):
    assert "--meta-only needs a config.json" in cli.fails("params", smollm2, "--meta-only", code=2)


def test_corrupt_gguf(cli, tmp_path, smollm2):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    assert "corrupt" in cli.fails("params", fake, code=1)
    short = tmp_path / "short.gguf"
    short.write_bytes(smollm2.read_bytes()[:5000])
    assert "truncated" in cli.fails("tied", short, code=1)
    notgguf = tmp_path / "text.gguf"
    notgguf.write_text("hello, this is not a model file at all")
    assert "not a GGUF file" in cli.fails("params", notgguf, code=1)


def test_internal_errors_are_one_line_and_debug_shows_the_traceback(cli, tiny, monkeypatch):
    import embedlens.analysis.params as params_module

    def boom(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(params_module, "params_report", boom)
    err = cli.fails("params", tiny("llama-tied"), code=1)
    assert "error: internal error: ZeroDivisionError: division by zero" in err
    result = cli("params", tiny("llama-tied"), "--debug")
    assert result.exit_code == 1 and "Traceback" in result.stderr


def test_config_with_nonsense_sizes(cli, tmp_path):
    folder = write_config(
        tmp_path / "neg",
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": -5},
    )
    assert "vocabulary size of -5" in cli.fails("params", folder, "--meta-only", code=1)


def test_json_config_not_an_object(cli, tmp_path):
    folder = tmp_path / "list"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps([1, 2]))
    assert "does not hold a JSON object" in cli.fails("params", folder, code=1)
