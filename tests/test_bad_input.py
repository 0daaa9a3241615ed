"""The bad-input suite: broken models and bad arguments across the five commands.

Every case must end in the contract's error: one `error:` line (and maybe a `hint:` line) on
stderr, nothing on stdout, no traceback, exit 1 (run time) or 2 (usage). Each case runs in an
empty working folder that must stay empty; broken models are built from copies
(tests.badinputs), and the last test checks that the good inputs every case read (the tiny model
folders and the SmolLM2 file) are byte for byte what they were before the suite.
(test_bad_input_structure.py holds the older params/tied cases; these do not repeat them.)
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests.badinputs import MAKERS

COMMANDS = ("params", "tied", "neighbors", "addr", "lens")
# What each command needs besides MODEL to get going.
TAIL = {"params": [], "tied": [], "neighbors": ["king"], "addr": ["3"], "lens": ["the king"]}

# Broken models: the part of the error line every command must give.
BROKEN = {
    "missing-path": "no such file or directory",
    "empty-folder": "has no config.json (it holds nothing)",
    "no-config": "has no config.json (it holds chat_template.jinja",
    "config-empty": "config.json' is not valid JSON",
    "config-not-utf8": "config.json': 'utf-8' codec can't decode byte 0xff",
    "config-a-list": "config.json' does not hold a JSON object",
    "encoder-only": "model type 'bert' is an encoder-only model, not a causal LM",
    "st-truncated": "'model.safetensors' is truncated",
    "st-header-beyond-file": "its header claims 1099511627776 bytes",
    "st-header-not-json": "'model.safetensors' has a corrupt header (not JSON",
    "st-offsets-outside": "'model.safetensors' is truncated: tensor",
    "st-overlapping": "overlaps the tensor before it",
    "shard-missing": "named in model.safetensors.index.json is missing from",
    "index-not-json": "'model.safetensors.index.json' is not a valid safetensors index",
    "index-shard-outside": "names a shard outside the model: '../../etc/passwd'",
    "gguf-empty": "'empty.gguf' is too short to be a GGUF file",
    "gguf-fake": "'fake.gguf' is corrupt",
    "gguf-not-gguf": "'text.gguf' is not a GGUF file",
    "gguf-truncated": "'short.gguf' is truncated or corrupt",
    "gguf-version-1": "'v1.gguf' has GGUF version 1",
    "gguf-unsupported-quant": "tensor 'token_embd.weight' has ggml type 99, which embedlens cannot",
    "not-a-model-file": "is a file but not a model",
    "embedding-width-0": "its embedding 'model.embed_tokens.weight' has shape [72, 0], with rows",
    "embedding-rows-0": "its embedding 'model.embed_tokens.weight' has shape [0, 32], with no rows",
    "config-nested-deep": "config.json' is nested too deeply to be a config",
    "config-symlink-loop": "config.json': its symbolic links form a loop",
    "gguf-unaligned": "tensor 'token_embd.weight' starts at data offset 4, which breaks the file's",
    "gguf-merge-without-space": "tokenizer.ggml.merges[5] 're' has no space between its two tokens",
    "gguf-tokens-as-numbers": "tokenizer.ggml.tokens is an array of GGUF type 5, not a list of str",
    "gguf-token-not-utf8": "tokenizer.ggml.tokens[7] b'\\xff\\xfe<gh_stars>' is not valid UTF-8",
    "rope-type-unknown": "config.json of '{model}' asks for rope type 'bogus', which transformers",
    "tokenizer-without-added-tokens": "'tokenizer.json' has no 'added_tokens' list",
    "no-tokenizer-json": "has no tokenizer.json",
}
assert set(BROKEN) == set(MAKERS)
# The commands a broken model reaches; the others never read the broken part (params and tied
# read no tokenizer, only lens builds the model).
ONLY: dict[str, tuple[str, ...]] = {
    "gguf-merge-without-space": ("neighbors", "addr", "lens"),
    "gguf-tokens-as-numbers": ("neighbors", "addr", "lens"),
    "gguf-token-not-utf8": ("neighbors", "addr", "lens"),
    "rope-type-unknown": ("lens",),
    "tokenizer-without-added-tokens": ("lens",),
    "no-tokenizer-json": ("neighbors", "lens"),
}

# Bad arguments to good models: (command, model, arguments, exit code, part of the error line).
T, S = "{tiny}", "{smol}"
BAD_ARGS: list[tuple[str, str, list[str], int, str]] = [
    ("params", "", [], 1, "MODEL is empty"),
    ("tied", "   ", [], 1, "MODEL is empty"),
    ("params", T, ["--device", "cuda:x"], 2, "unknown device 'cuda:x'"),
    ("tied", T, ["--load", "--device", "cuda:7"], 2, "--device cuda:7 was asked for, but"),
    ("neighbors", T, [""], 2, "empty query"),
    ("neighbors", T, ["   "], 2, "' ' encodes to no tokens"),
    ("neighbors", T, ["\x00\x07"], 2, "'\\x00\\x07' is not in the vocabulary"),
    ("neighbors", S, ["ki\udcffng"], 2, "b'ki\\xffng' is not valid UTF-8 text"),
    ("neighbors", T, ["king", "-k", "0"], 2, "-k must be at least 1 (got 0)"),
    ("neighbors", T, ["king", "-k", str(10**12)], 2, "-k 1000000000000 is more than the 54 rows"),
    ("neighbors", T, ["--id", "999999"], 2, "row 999999 is out of range"),
    ("neighbors", T, ["--id", "-1"], 2, "row -1 is negative"),
    ("neighbors", T, ["king", "--matrix", "sideways"], 2, "unknown matrix 'sideways'"),
    ("neighbors", T, ["zzzunknownword"], 2, "'zzzunknownword' is not in the vocabulary"),
    ("neighbors", T, ["king - "], 2, "cannot parse the expression 'king - '"),
    ("neighbors", T, [], 2, "no query given"),
    ("neighbors", S, ["king", "--dtype", "float8"], 2, "unknown dtype 'float8'"),
    ("neighbors", S, ["king", "--device", "tpu"], 2, "unknown device 'tpu'"),
    ("addr", T, ["72"], 2, "row 72 is out of range: the table has 72 rows"),
    ("addr", S, [str(10**30)], 2, f"row {10**30} is out of range"),
    ("addr", T, [""], 2, "empty ROW"),
    ("addr", T, [" \t "], 2, "encodes to no tokens"),
    ("addr", S, ["\udcff\udcfe"], 2, "b'\\xff\\xfe' is not valid UTF-8 text"),
    ("addr", T, ["3", "--tp", "0"], 2, "--tp must be at least 1 (got 0)"),
    ("addr", T, ["3", "--tokens", "-5"], 2, "--tokens must be at least 1 (got -5)"),
    ("addr", T, ["3", "--matrix", "x"], 2, "unknown matrix 'x'"),
    ("lens", T, [""], 2, "the prompt is empty"),
    ("lens", T, ["  \t  "], 2, "the prompt is empty"),
    ("lens", T, [" ".join(["king"] * 100)], 2, "is 100 tokens, longer than the model's context"),
    ("lens", T, ["the king", "--layers", "99"], 2, "layer 99 is out of range"),
    ("lens", T, ["the king", "--layers", "a-b"], 2, "malformed --layers 'a-b'"),
    ("lens", T, ["the king", "-k", "0"], 2, "-k must be at least 1, not 0"),
    ("lens", T, ["the king", "--position", "1000"], 2, "position 1000 is out of range"),
    ("lens", T, ["ki\udcffng"], 2, "b'ki\\xffng' is not valid UTF-8 text"),
    ("lens", T, ["the king", "--target", ""], 2, "--target '' encodes to no token"),
    ("lens", T, ["the king", "--dtype", "float8"], 2, "unknown dtype 'float8'"),
    ("lens", T, ["the king", "--device", "tpu"], 2, "unknown device 'tpu'"),
]


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted([path] if path.is_file() else path.rglob("*")):
        h.update(str(f).encode())
        if f.is_file():
            with open(f, "rb") as fh:
                for block in iter(lambda fh=fh: fh.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()


@pytest.fixture(scope="module")
def originals(tiny, smollm2) -> dict[Path, str]:
    """The good inputs the suite reads, hashed before its first case (module scope)."""
    paths = [tiny("llama-tied"), tiny("llama-tied", max_shard_size="20KB"), smollm2]
    return {p: _digest(p) for p in paths}


@pytest.fixture
def run_in_empty_folder(cli, tmp_path, monkeypatch, originals):
    """Run a command from an empty working folder, then check the folder is still empty."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)

    def run(*args: str, code: int) -> str:
        err = cli.fails(*args, code=code)
        assert not list(cwd.iterdir()), list(cwd.iterdir())
        return err

    return run


def _broken_cases() -> list[object]:
    return [
        pytest.param(broken, command, id=f"{broken}-{command}")
        for broken in sorted(BROKEN)
        for command in ONLY.get(broken, COMMANDS)
    ]


@pytest.mark.parametrize(("broken", "command"), _broken_cases())
def test_broken_model(run_in_empty_folder, tiny, smollm2, tmp_path, broken, command):
    work = tmp_path / "work"
    work.mkdir()
    model = MAKERS[broken](work, tiny, smollm2)
    before = _digest(work)
    err = run_in_empty_folder(command, model, *TAIL[command], code=1)
    assert BROKEN[broken].format(model=model) in err.splitlines()[0], err
    assert _digest(work) == before  # the broken copy itself is left as it was


@pytest.mark.parametrize(
    ("command", "model", "args", "code", "says"),
    BAD_ARGS,
    ids=[f"{c}-{i}" for i, (c, *_) in enumerate(BAD_ARGS)],
)
def test_bad_arguments(run_in_empty_folder, tiny, smollm2, command, model, args, code, says):
    model = model.format(tiny=tiny("llama-tied"), smol=smollm2)
    err = run_in_empty_folder(command, model, *args, code=code)
    assert says in err.splitlines()[0], err


def test_a_model_path_that_is_not_utf8(tiny, tmp_path):
    """A path whose name is not UTF-8 works, with stdout in strict UTF-8: JSON escapes it (and
    gives its bytes back through surrogateescape), a table prints its bytes as ls does."""
    import json
    import os
    import subprocess
    import sys

    link = os.fsencode(tmp_path) + b"/model-\xff"
    os.symlink(tiny("llama-tied"), link)
    env = {
        **os.environ,
        "PYTHONIOENCODING": "utf-8:strict",
        "HF_HUB_OFFLINE": "1",
        "COLUMNS": "300",
    }
    command = [os.fsencode(sys.executable), b"-m", b"embedlens", b"params", link]
    result = subprocess.run([*command, b"--json"], capture_output=True, env=env, check=False)
    assert (result.returncode, result.stderr) == (0, b"")
    assert json.loads(result.stdout)["model"].encode("utf-8", "surrogateescape") == link
    result = subprocess.run(command, capture_output=True, env=env, check=False)
    assert (result.returncode, result.stderr) == (0, b"") and b"\xff" in result.stdout


def test_inputs_unchanged_after_the_suite(originals):
    """Runs last in this module: the good inputs all cases read are as they were."""
    assert {p: _digest(p) for p in originals} == originals


def _nonfinite_rows(tiny, tmp_path: Path) -> tuple[Path, dict[str, int]]:
    """The tiny model with the rows of 'cat' and 'dog' set to NaN and inf."""
    import json
    import shutil
    import struct

    import numpy as np

    folder = tmp_path / "nonfinite"
    shutil.copytree(tiny("llama-tied"), folder)
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    ids = {"cat": vocab["cat"], "dog": vocab["dog"]}
    weights = folder / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    entry = json.loads(raw[8 : 8 + n])["model.embed_tokens.weight"]
    begin = 8 + n + entry["data_offsets"][0]
    table = np.frombuffer(raw, np.float32, 72 * 32, begin).reshape(72, 32).copy()
    table[ids["cat"]] = np.nan
    table[ids["dog"], 3] = np.inf
    raw[begin : begin + table.nbytes] = table.tobytes()
    weights.write_bytes(bytes(raw))
    return folder, ids


def test_rows_holding_nan_or_inf_are_left_out_with_a_note(cli, tiny, tmp_path):
    folder, ids = _nonfinite_rows(tiny, tmp_path)
    data = cli.json("neighbors", folder, "cats", "-k", "53")
    found = {n["id"] for n in data["queries"][0]["neighbors"]}
    assert not found & set(ids.values())
    assert data["searched_rows"] == 54 - 2
    assert any(
        "2 rows of 'model.embed_tokens.weight' hold NaN or inf values" in note
        and f"{min(ids.values())}, {max(ids.values())}" in note
        for note in data["notes"]
    ), data["notes"]


@pytest.mark.parametrize(("word", "says"), [("cat", "NaN values"), ("dog", "inf values")])
def test_a_query_on_a_row_holding_nan_or_inf(cli, tiny, tmp_path, word, says):
    folder, ids = _nonfinite_rows(tiny, tmp_path)
    err = cli.fails("neighbors", folder, word, code=1)
    assert f"row {ids[word]} ('{word}') of 'model.embed_tokens.weight' holds {says}" in err


COMMAND_TAIL = [pytest.param(c, id=c) for c in COMMANDS]


@pytest.mark.parametrize("command", COMMAND_TAIL)
def test_an_unreadable_model_folder(tiny, tmp_path, command):
    """A folder its user may not read, in a real process. Root reads anything, so as root the
    process runs without the capabilities that bypass permissions (setpriv)."""
    import os
    import shutil
    import subprocess
    import sys

    prefix: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: permissions cannot be enforced")
        prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]
    folder = tmp_path / "model"
    shutil.copytree(tiny("llama-tied"), folder)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    os.chmod(folder, 0)
    try:
        result = subprocess.run(
            [*prefix, sys.executable, "-m", "embedlens", command, str(folder), *TAIL[command]],
            capture_output=True, text=True, cwd=cwd, check=False,
        )  # fmt: skip
    finally:
        os.chmod(folder, 0o755)
    assert (result.returncode, result.stdout) == (1, ""), result
    lines = result.stderr.strip().splitlines()
    assert lines[0] == f"error: cannot read '{folder}/config.json': permission denied", lines
    assert len(lines) == 2 and lines[1].startswith("hint: check the permissions")
    assert not list(cwd.iterdir())
