"""No foreign code runs: a model's own Python files, and pickles that carry code.

Each payload, if it ever ran, would create a marker file; every test proves the marker is absent
after the command, and a control proves the payload does run when it is let in.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

COMMANDS = {
    "params": [],
    "params --meta-only": ["--meta-only"],
    "params --load": ["--load"],
    "tied --load": ["--load"],
    "neighbors": ["king"],
    "addr": ["3"],
    "lens": ["the king"],
}


def _remote_code_model(folder: Path, tiny_folder: Path, marker: Path) -> Path:
    """The tiny Llama's weights and tokenizer under a config that maps to the repo's own code."""
    shutil.copytree(tiny_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="evil_lm",
        architectures=["EvilForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_evil.EvilConfig",
            "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
            "AutoTokenizer": ["tokenization_evil.EvilTokenizer", None],
        },
    )
    (folder / "config.json").write_text(json.dumps(config))
    payload = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
    for name in ("configuration_evil.py", "modeling_evil.py", "tokenization_evil.py"):
        (folder / name).write_text(payload)
    return folder


# Commands that read headers, the tokenizer and one matrix: no model code could run, so a model
# that needs its repository's code is read, not refused.
HEADER_ONLY = ("neighbors", "addr")


@pytest.mark.parametrize("command", sorted(c for c in COMMANDS if c not in HEADER_ONLY))
def test_remote_code_never_runs(cli, tiny, tmp_path, command):
    marker = tmp_path / "marker"
    folder = _remote_code_model(tmp_path / "evil", tiny("llama-tied"), marker)
    name = command.split()[0]
    err = cli.fails(name, folder, *COMMANDS[command], code=1)
    assert "needs code from" in err
    assert (
        "hint: embedlens never runs a model's own code unless you pass --trust-remote-code" in err
    )
    assert not marker.exists()


@pytest.mark.parametrize("command", HEADER_ONLY)
def test_header_commands_read_a_remote_code_model_without_running_it(cli, tiny, tmp_path, command):
    """neighbors and addr offer no --trust-remote-code: they read the model, and its code never
    runs."""
    marker = tmp_path / "marker"
    folder = _remote_code_model(tmp_path / "evil", tiny("llama-tied"), marker)
    plain = cli.json(command, tiny("llama-tied"), *COMMANDS[command])
    data = cli.json(command, folder, *COMMANDS[command])
    assert not marker.exists()
    assert {**data, "model": ""} == {**plain, "model": ""}


def test_remote_code_control(cli, tiny, tmp_path):
    """Let in, the same repository's code does run (so the tests above can fail)."""
    marker = tmp_path / "marker"
    folder = _remote_code_model(tmp_path / "evil", tiny("llama-tied"), marker)
    cli("params", folder, "--meta-only", "--trust-remote-code")
    assert marker.read_text() == "ran"


class _Payload:
    """Unpickling this calls open(marker, 'w'): the file appears if the pickle's code runs."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (self.marker, "w"))


def _pickle_model(folder: Path, tiny_folder: Path, marker: Path) -> Path:
    """The tiny Llama with its weights in pytorch_model.bin, one entry of which carries code."""
    import torch
    from safetensors.torch import load_file

    folder.mkdir()
    for f in tiny_folder.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, folder / f.name)
    state = load_file(tiny_folder / "model.safetensors")
    state["lm_head.extra"] = _Payload(marker)
    torch.save(state, folder / "pytorch_model.bin")
    return folder


def test_pickle_control(tiny, tmp_path):
    """The pickle does carry code: torch.load without weights_only runs it."""
    import torch

    marker = tmp_path / "marker"
    folder = _pickle_model(tmp_path / "bin", tiny("llama-tied"), marker)
    torch.load(folder / "pytorch_model.bin", weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("command", ["params --load", "tied --load", "lens"])
def test_pickle_code_never_runs(cli, tiny, tmp_path, command):
    marker = tmp_path / "marker"
    folder = _pickle_model(tmp_path / "bin", tiny("llama-tied"), marker)
    name = command.split()[0]
    err = cli.fails(name, folder, *COMMANDS[command], code=1)
    assert not marker.exists()
    assert "internal error" not in err
    if name != "tied":  # tied reads the headers first, and a .bin has none
        expected = (
            f"error: '{folder}' holds more than weights: the weights-only loader refused its "
            "pickle (it calls io.open)"
        )
        assert expected in err, err
        assert "hint: embedlens never runs code from a checkpoint" in err


@pytest.mark.parametrize(
    ("command", "args"), [("params", []), ("tied", []), ("neighbors", ["king"]), ("addr", ["3"])]
)
def test_pickles_are_not_read_by_the_header_commands(cli, tiny, tmp_path, command, args):
    """Commands that read headers or one matrix never open a pickle at all."""
    marker = tmp_path / "marker"
    folder = _pickle_model(tmp_path / "bin", tiny("llama-tied"), marker)
    result = cli(command, folder, *args)
    assert not marker.exists()
    assert result.exit_code in (0, 1) and "Traceback" not in result.stderr


def _builtin_type_with_auto_map(folder: Path, tiny_folder: Path, marker: Path) -> Path:
    """The tiny Llama (a type transformers has built in) whose config also maps to repo code."""
    _remote_code_model(folder, tiny_folder, marker)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config))
    return folder


BUILT = {
    "params --meta-only": ["--meta-only"],
    "params --load": ["--load"],
    "tied --load": ["--load"],
    "lens": ["the king"],
}


@pytest.mark.parametrize("command", sorted(BUILT))
def test_auto_map_over_a_built_in_type_says_the_built_in_class_ran(cli, tiny, tmp_path, command):
    marker = tmp_path / "marker"
    folder = _builtin_type_with_auto_map(tmp_path / "m", tiny("llama-tied"), marker)
    name = command.split()[0]
    result = cli(name, folder, *BUILT[command])
    assert result.exit_code == 0, result.stderr
    assert not marker.exists()
    said = [ln for ln in result.stderr.splitlines() if "auto_map" in ln]
    assert said == [
        "note: the repository's own model code (auto_map) was not run: transformers' built-in "
        "'llama' implementation was used; --trust-remote-code would run the repository's code "
        "instead"
    ], result.stderr
    quiet = cli(name, folder, *BUILT[command], "--quiet")
    assert quiet.exit_code == 0 and "auto_map" not in quiet.stderr
    plain = cli(name, tiny("llama-tied"), *BUILT[command])
    assert "auto_map" not in plain.stderr


def test_auto_map_note_goes_with_trust_remote_code(cli, tiny, tmp_path):
    """With --trust-remote-code the repository's code runs, and the note is not printed."""
    marker = tmp_path / "marker"
    folder = _builtin_type_with_auto_map(tmp_path / "m", tiny("llama-tied"), marker)
    result = cli("params", folder, "--meta-only", "--trust-remote-code")
    assert "auto_map" not in result.stderr
