"""The bad-input suite: broken models and bad arguments across the six commands.

Every case must end in the contract's error: one `error:` line (and maybe a `hint:` line) on
stderr, nothing on stdout, no traceback, exit 1 (run time) or 2 (usage). Each case runs in an
empty working folder that must stay empty; broken models are built from copies
(tests.badinputs), and the last test checks that the good inputs every case read (the tiny model
folders and the SmolLM2 file) are byte for byte what they were before the suite.
(test_bad_input_structure.py holds the older params/tied cases; these do not repeat them.)
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.badinputs import MAKERS
from tests.conftest import release_note

COMMANDS = ("params", "tied", "neighbors", "addr", "lens", "vocab")
# What each command needs besides MODEL to get going.
TAIL = {
    "params": [],
    "tied": [],
    "neighbors": ["king"],
    "addr": ["3"],
    "lens": ["the king"],
    "vocab": [],
}

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
    "gguf-no-tokenizer": "'notok.gguf' carries no tokenizer in its metadata",
    "gguf-tokenizer-unknown": "'foo.gguf' has a 'foo' tokenizer; embedlens rebuilds 'gpt2'",
    "gguf-no-merges": "'nomerges.gguf' has a byte-level vocabulary (tokenizer.ggml.model 'gpt2') "
    "without merges",
    "rope-type-unknown": "config.json of '{model}' asks for rope type 'bogus', which transformers",
    "tokenizer-without-added-tokens": "'tokenizer.json' has no 'added_tokens' list",
    "no-tokenizer-json": "has no tokenizer.json",
    "embedding-int8": "model.embed_tokens.weight is stored as I8, an integer type, and "
    "config.json has no quantization_config to say how to read it",
    "chat-template-loops": "chat_template.jinja' renders more than 4,096 characters",
    "chat-template-huge": "chat_template.jinja' computes a value of about 20,000,000 characters",
    "chat-template-repeats": "tokenizer_config.json' computes a value of about 10,000,000,000 "
    "characters with '*', more than the 4,096",
    "chat-template-power": "tokenizer_config.json' computes a value of about 8,450,980,401 "
    "characters with '**'",
    "chat-template-range": "tokenizer_config.json' fails: Range too big",
    "chat-template-raises": "tokenizer_config.json' fails: Conversation roles must alternate "
    "user/assistant",
}
assert set(BROKEN) == set(MAKERS)
# The commands a broken model reaches; the others never read the broken part (params and tied
# read no tokenizer, only lens builds the model).
ONLY: dict[str, tuple[str, ...]] = {
    "gguf-merge-without-space": ("neighbors", "addr", "lens", "vocab"),
    "gguf-tokens-as-numbers": ("neighbors", "addr", "lens", "vocab"),
    "gguf-token-not-utf8": ("neighbors", "addr", "lens", "vocab"),
    "gguf-no-tokenizer": ("neighbors", "addr", "lens", "vocab"),
    "gguf-tokenizer-unknown": ("neighbors", "addr", "lens", "vocab"),
    "gguf-no-merges": ("neighbors", "addr", "lens", "vocab"),
    "rope-type-unknown": ("lens",),
    "tokenizer-without-added-tokens": ("lens",),
    "no-tokenizer-json": ("neighbors", "lens", "vocab"),
    "embedding-int8": ("neighbors", "lens", "vocab"),  # params, tied, addr read no values
    "chat-template-loops": ("lens",),
    "chat-template-huge": ("lens",),
    "chat-template-repeats": ("lens",),
    "chat-template-power": ("lens",),
    "chat-template-range": ("lens",),
    "chat-template-raises": ("lens",),
}
# What a broken model needs besides TAIL to reach its broken part.
EXTRA: dict[str, list[str]] = {
    "chat-template-loops": ["--chat", "hello"],
    "chat-template-huge": ["--chat", "hello"],
    "chat-template-repeats": ["--chat", "hello"],
    "chat-template-power": ["--chat", "hello"],
    "chat-template-range": ["--chat", "hello"],
    "chat-template-raises": ["--chat", "hello"],
}
# `addr` given row ids reads only those rows' tokens; a token's text makes it read the whole
# tokenizer, where these broken parts lie (test_addr covers a row id on a broken token).
TAIL_FOR: dict[tuple[str, str], list[str]] = {
    (broken, "addr"): [" king"]
    for broken in (
        "gguf-merge-without-space",
        "gguf-token-not-utf8",
        "gguf-no-tokenizer",
        "gguf-tokenizer-unknown",
        "gguf-no-merges",
    )
}

# Bad arguments to good models: (command, model, arguments, exit code, part of the error line).
T, S, M = "{tiny}", "{smol}", "no-such-model"
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
    ("neighbors", T, ["king", "--matrix", "sideways"], 2, "'sideways' is not one of 'input'"),
    ("neighbors", T, ["zzzunknownword"], 2, "'zzzunknownword' is not in the vocabulary"),
    ("neighbors", T, ["king - "], 2, "cannot parse the expression 'king - '"),
    ("neighbors", T, [], 2, "no query given"),
    ("neighbors", S, ["king", "--dtype", "float32"], 2, "No such option: --dtype"),
    ("neighbors", S, ["king", "--device", "cpu"], 2, "No such option: --device"),
    ("addr", T, ["3", "--trust-remote-code"], 2, "No such option: --trust-remote-code"),
    ("addr", T, ["72"], 2, "row 72 is out of range: the table has 72 rows"),
    ("addr", S, [str(10**30)], 2, f"row {10**30} is out of range"),
    ("addr", T, [""], 2, "empty ROW"),
    ("addr", T, [" \t "], 2, "encodes to no tokens"),
    ("addr", S, ["\udcff\udcfe"], 2, "b'\\xff\\xfe' is not valid UTF-8 text"),
    ("addr", T, ["3", "--tp", "0"], 2, "--tp must be at least 1 (got 0)"),
    ("addr", T, ["3", "--tokens", "-5"], 2, "--tokens must be at least 1 (got -5)"),
    ("addr", T, ["3", "--matrix", "x"], 2, "'x' is not one of 'input', 'output'"),
    ("lens", T, [""], 2, "the prompt is empty"),
    ("lens", T, ["  \t  "], 2, "the prompt is empty"),
    ("lens", T, [" ".join(["king"] * 100)], 2, "is 100 tokens, longer than the model's context"),
    ("lens", T, ["the king", "--layers", "99"], 2, "layer 99 is out of range"),
    ("lens", T, ["the king", "--layers", "a-b"], 2, "malformed --layers 'a-b'"),
    ("lens", T, ["the king", "-k", "0"], 2, "-k must be at least 1, not 0"),
    ("lens", T, ["the king", "--position", "1000"], 2, "position 1000 is out of range"),
    ("lens", T, ["ki\udcffng"], 2, "b'ki\\xffng' is not valid UTF-8 text"),
    ("lens", T, ["the king", "--target", ""], 2, "--target '' encodes to no token"),
    ("lens", T, ["the king", "--dtype", "float8"], 2, "Invalid value for '--dtype': 'float8'"),
    ("lens", T, ["the king", "--device", "tpu"], 2, "unknown device 'tpu'"),
    # values that are not sizes, refused before anything loads (the model does not exist)
    ("lens", M, ["hi", "--device-map", "auto", "--max-memory", "cpu=lots"], 2,
     "--max-memory 'cpu=lots': 'lots' is not a size"),
    ("lens", M, ["hi", "--device-map", "auto", "--max-memory", "0=1e400"], 2,
     "--max-memory '0=1e400': '1e400' is not a size"),
    ("lens", M, ["hi", "--device-map", "auto", "--offload-folder", "{tiny}/config.json"], 2,
     "config.json' is not a folder"),
    ("neighbors", T, ["king - king"], 2, "'king - king' adds up to the zero vector"),
    ("neighbors", S, ["' king' - ' king' + ' cat' - ' cat'"], 2, "adds up to the zero vector"),
    ("neighbors", T, ["king", "--pool", "middle"], 2, "'middle' is not one of 'first', 'mean'"),
    ("lens", S, ["hi", "--device-map", "auto", "--max-memory", "cpu=1MiB"], 1,
     "--device-map auto puts the whole model on disk, and a GGUF model offloaded to disk cannot"),
    ("lens", S, ["The capital of France is", "--target", "queen"], 2,
     "--target 'queen' is not a single token: it splits into 2 ('que', 'en')"),
    ("vocab", T, ["--max-verify", "0"], 2, "--max-verify must be at least 1 (got 0)"),
    ("vocab", T, ["--against", "no-such-tokenizer"], 1, "'no-such-tokenizer' is not in the local hub cache"),
    ("vocab", T, ["--tokenizer", "{tiny}/config.json"], 1,
     "'config.json' has no 'added_tokens' list"),
    ("vocab", T, ["--dtype", "float8"], 2, "'float8' is not one of 'auto', 'float32'"),
]  # fmt: skip


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
    tail = TAIL_FOR.get((broken, command), TAIL[command])
    err = run_in_empty_folder(command, model, *tail, *EXTRA.get(broken, []), code=1)
    assert BROKEN[broken].format(model=model) in err.splitlines()[0], err
    assert _digest(work) == before  # the broken copy itself is left as it was


@pytest.mark.parametrize(
    ("command", "model", "args", "code", "says"),
    BAD_ARGS,
    ids=[f"{c}-{i}" for i, (c, *_) in enumerate(BAD_ARGS)],
)
def test_bad_arguments(run_in_empty_folder, tiny, smollm2, command, model, args, code, says):
    model = model.format(tiny=tiny("llama-tied"), smol=smollm2)
    args = [a.replace("{tiny}", str(tiny("llama-tied"))) for a in args]
    err = run_in_empty_folder(command, model, *args, code=code)
    assert says in err.splitlines()[0], err


@pytest.mark.parametrize("limit", ["1e400", "lots", "-5GiB"])
@pytest.mark.parametrize("command", COMMANDS)
def test_memory_limit_that_is_not_a_size(run_in_empty_folder, command, limit, monkeypatch):
    """A bad EMBEDLENS_MEMORY_LIMIT is a usage error before anything loads (MODEL is missing)."""
    monkeypatch.setenv("EMBEDLENS_MEMORY_LIMIT", limit)
    err = run_in_empty_folder(command, "no-such-model", *TAIL[command], code=2)
    assert f"EMBEDLENS_MEMORY_LIMIT='{limit}' is not a size" in err.splitlines()[0], err


def test_rows_near_float32s_largest_value(cli, tiny, tmp_path):
    """A row of values near float32's largest overflows float32 arithmetic: it still gets its
    true cosine (not NaN), and no numpy RuntimeWarning reaches stderr."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "model"
    shutil.copytree(tiny("llama-tied"), folder)
    weights = load_file(folder / "model.safetensors")
    name = next(k for k in weights if "embed_tokens" in k)
    table = weights[name]
    row = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]["book"]
    table[row] = np.sign(table[row]) * np.float32(3e38)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    result = cli("neighbors", folder, "king", "-k", "53", "--json")
    assert (result.exit_code, result.stderr) == (0, ""), result.stderr
    found = {n["id"]: n["cosine"] for n in json.loads(result.stdout)["queries"][0]["neighbors"]}
    king = table[json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]["king"]]
    a, b = table[row].astype(np.float64), king.astype(np.float64)
    want = a @ b / np.linalg.norm(a) / np.linalg.norm(b)
    assert found[row] == pytest.approx(want, abs=1e-6)
    result = cli("neighbors", folder, "book", "king - man + woman")
    assert (result.exit_code, result.stderr) == (0, ""), result.stderr


@pytest.mark.slow
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


# Hostile text: names that are Rich markup or hold escape sequences, shown as written (escaped).
HOSTILE_NAMES = {"markup-close": "a[/]b", "markup-style": "my[red]model", "escape": "x\x1b[31mred"}
HOSTILE_TOKEN = "bo[red]ok\x1b[2J\x9b31m[/]"


def _no_raw_controls(text: str) -> None:
    from embedlens.text import visible

    lines = text.splitlines()
    assert all(line == visible(line) for line in lines), text


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("name", sorted(HOSTILE_NAMES))
def test_hostile_model_path_is_shown_as_written(cli, tiny, tmp_path, monkeypatch, name, command):
    """A MODEL path that is Rich markup or holds ESC: the run works, the name is shown escaped."""
    from embedlens.text import visible

    raw = HOSTILE_NAMES[name]
    monkeypatch.chdir(tmp_path)
    folder = Path("dir") / raw
    folder.parent.mkdir(parents=True, exist_ok=True)
    folder.symlink_to(tiny("llama-tied"))
    result = cli(command, folder, *TAIL[command], env={"COLUMNS": "400"})
    assert result.exit_code == 0, (result.stdout, result.stderr)
    _no_raw_controls(result.stdout + result.stderr)
    if command in ("params", "tied"):  # titles name a local path by its last part
        assert f" of {visible(folder.name)} " in result.stdout, result.stdout
    if command == "lens":
        assert f"Logit lens of {visible(folder.name)} after" in result.stdout, result.stdout
    err = cli.fails(command, Path("missing") / raw, *TAIL[command], code=1)
    assert visible(raw) in err.splitlines()[0] and "\x1b" not in err


@pytest.mark.parametrize(
    "args",
    [("neighbors", "--id", "{row}", "-k", "50"), ("neighbors", "king", "-k", "53"),
     ("addr", "{row}"), ("addr", HOSTILE_TOKEN), ("lens", "the king", "--position", "all")],
)  # fmt: skip
def test_hostile_token_is_shown_escaped(cli, tiny, tmp_path, args):
    """A vocabulary entry holding markup, ESC and CSI (U+009B) is shown escaped in every table."""
    from embedlens.text import visible

    folder = tmp_path / "model"
    shutil.copytree(tiny("llama-tied"), folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    row = vocab.pop("book")
    vocab[HOSTILE_TOKEN] = row
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    command, *rest = args
    argv = [a.format(row=row) for a in rest]
    result = cli(command, folder, *argv, env={"COLUMNS": "400"})
    assert result.exit_code == 0, (result.stdout, result.stderr)
    _no_raw_controls(result.stdout + result.stderr)
    if command != "lens":  # the lens shows the row only where the model happens to predict it
        assert "'" + visible(HOSTILE_TOKEN) + "'" in result.stdout, result.stdout


def test_hostile_config_value_in_an_error(cli, tmp_path):
    """A config value that is markup and an escape sequence, quoted in an error line."""
    from embedlens.text import visible

    folder = tmp_path / "model"
    folder.mkdir()
    bad = "ll[/]ama\x1b]0;pwned\x07"
    (folder / "config.json").write_text(json.dumps({"model_type": bad}))
    err = cli.fails("params", folder, "--meta-only", code=1)
    assert visible(bad) in err and "\x1b" not in err and "\x07" not in err


# Output that cannot be written, in real processes: stdout closed (`>&-`), full (`/dev/full`), or
# a file that stops growing part of the way (RLIMIT_FSIZE).
def _run_with_stdout(argv: list[str], stdout: Any, **kwargs: Any) -> Any:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "EMBEDLENS_DEBUG"}
    return subprocess.run(
        [sys.executable, "-m", "embedlens", *argv],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "HF_HUB_OFFLINE": "1"},
        timeout=180,
        check=False,
        **kwargs,
    )


def _one_error_line(stderr: str, says: str) -> None:
    lines = [line for line in stderr.strip().splitlines() if not release_note(line)]
    assert lines and lines[0].startswith("error: ") and says in lines[0], stderr
    assert len(lines) <= 2 and all(line.startswith(("error: ", "hint: ")) for line in lines)
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr


@pytest.mark.slow
@pytest.mark.parametrize("as_json", [True, False], ids=["json", "table"])
@pytest.mark.parametrize("command", COMMANDS)
def test_closed_stdout(tiny, command, as_json):
    argv = [command, str(tiny("llama-tied")), *TAIL[command]] + (["--json"] if as_json else [])
    result = _run_with_stdout(argv, stdout=None, pass_fds=(), preexec_fn=_close_stdout)
    assert result.returncode == 1
    _one_error_line(result.stderr, "cannot write the output: stdout is closed")


def _close_stdout() -> None:
    import os

    os.close(1)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize(
    ("command", "as_json"),
    [(c, True) for c in COMMANDS] + [("params", False), ("addr", False)],
)
@pytest.mark.slow
def test_full_stdout(tiny, command, as_json):
    argv = [command, str(tiny("llama-tied")), *TAIL[command]] + (["--json"] if as_json else [])
    with open("/dev/full", "w") as full:
        result = _run_with_stdout(argv, stdout=full)
    assert result.returncode == 1
    _one_error_line(result.stderr, "cannot write the output to stdout: No space left on device")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("argv", [[], ["params", "--help"]], ids=["usage", "help"])
def test_help_that_cannot_be_written(argv):
    with open("/dev/full", "w") as full:
        result = _run_with_stdout(argv, stdout=full)
    assert result.returncode == 1
    _one_error_line(result.stderr, "cannot write the output to stdout: No space left on device")
    if not argv:
        result = _run_with_stdout(argv, stdout=None, preexec_fn=_close_stdout)
        assert result.returncode == 1
        _one_error_line(result.stderr, "cannot write the output: stdout is closed")


@pytest.mark.parametrize(
    ("command", "as_json"), [("params", True), ("neighbors", True), ("params", False)]
)
@pytest.mark.slow
def test_output_cut_short_is_taken_back(tiny, tmp_path, command, as_json):
    """The file stops growing after 100 bytes: what was written of the output is taken back."""
    import resource
    import signal

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))

    out = tmp_path / "out.json"
    argv = [command, str(tiny("llama-tied")), *TAIL[command]] + (["--json"] if as_json else [])
    with open(out, "w") as fh:
        result = _run_with_stdout(argv, stdout=fh, preexec_fn=limit)
    assert result.returncode == 1
    _one_error_line(result.stderr, "cannot write the output to stdout: File too large")
    assert out.read_bytes() == b""


# Files nobody asked for: with HOME and TMPDIR empty folders of their own, a run leaves them empty.
def _bare_env(tmp_path: Path) -> dict[str, str]:
    import os

    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    drop = ("EMBEDLENS_DEBUG", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "MPLCONFIGDIR")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("XDG_")}
    return {**env, "HOME": str(home), "TMPDIR": str(tmp), "HF_HUB_OFFLINE": "1"}


def _left_behind(env: dict[str, str]) -> list[str]:
    return sorted(
        str(p) for key in ("HOME", "TMPDIR") for p in Path(env[key]).rglob("*")
    )  # fmt: skip


@pytest.mark.parametrize(
    "args",
    [("lens", "the king", "--plot", "{out}/lens.png"), ("tied", "--load"),
     ("neighbors", "king"), ("lens", "the king", "--device-map", "auto")],
)  # fmt: skip
@pytest.mark.slow
def test_no_files_left_behind(tiny, tmp_path, args):
    import subprocess
    import sys

    env = _bare_env(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    command, *rest = args
    argv = [command, str(tiny("llama-tied")), *(a.format(out=out) for a in rest)]
    result = subprocess.run(
        [sys.executable, "-m", "embedlens", *argv, "--quiet"],
        capture_output=True, text=True, env=env, timeout=300, check=False, cwd=out,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert _left_behind(env) == []
    assert sorted(p.name for p in out.iterdir()) == (["lens.png"] if "--plot" in args else [])


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigterm_removes_the_offload_folder(tiny, tmp_path):
    """SIGTERM during `lens --device-map auto` unwinds like Ctrl-C: the offload folder goes."""
    import signal
    import subprocess
    import time

    env = _bare_env(tmp_path)
    argv = ["lens", str(tiny("llama-tied")), "the king", "--device-map", "auto", "--quiet"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "embedlens", *argv],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not list(Path(env["TMPDIR"]).rglob("embedlens-offload-*")):
            assert proc.poll() is None and time.monotonic() < deadline, "no offload folder made"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (proc.returncode, out, err) == (128 + signal.SIGTERM, "", "")
    assert _left_behind(env) == []


# Words: a word that splits into several tokens, or typed without the leading space it likely has.
BEIJING = [30158, 241, 16736, 122]  # '北京' in SmolLM2's byte-level vocabulary


@pytest.mark.parametrize("pool", ["first", "mean", "last"])
def test_a_split_word_is_said_and_pooled(cli, smollm2, pool):
    import numpy as np

    from tests.smol_reference import plain_neighbors, smol_table

    result = cli("neighbors", smollm2, "北京", "-k", "3", "--pool", pool, "--json")
    assert result.exit_code == 0, result.stderr
    q = json.loads(result.stdout)["queries"][0]
    assert [t["id"] for t in q["tokens"]] == BEIJING and q["split"] is True and q["pool"] == pool
    used = {"first": BEIJING[:1], "last": BEIJING[-1:], "mean": BEIJING}[pool]
    assert q["rows"] == used and q["token_id"] == (BEIJING[-1] if pool == "last" else BEIJING[0])
    said = {"first": "the first ('\\xe5\\x8c', id 30158) is queried (--pool mean",
            "last": "the last ('\\xac', id 122) is queried",
            "mean": "the mean of their unit rows is queried"}  # fmt: skip
    assert "note: '北京' splits into 4 tokens ('\\xe5\\x8c', '\\x97', " in result.stderr
    assert said[pool] in result.stderr, result.stderr
    ref = smol_table(smollm2)
    unit = ref.rows / np.linalg.norm(ref.rows, axis=1, keepdims=True)
    vector = unit[used].mean(axis=0)
    allowed = np.ones(len(ref.rows), dtype=bool)
    allowed[ref.control + used] = False
    assert [n["id"] for n in q["neighbors"]] == plain_neighbors(ref.rows, allowed, vector, 3)


@pytest.mark.parametrize(
    ("args", "says"),
    [(["neighbors", "{smol}", "cat"], "'cat' is token 9786, a rarer piece than ' cat' (token 2644"),
     (["neighbors", "{smol}", "queen"],
      "'queen' splits into 2 tokens, but ' queen' (token 15731, with its leading space) is one"),
     (["neighbors", "{smol}", "king - man + woman"], """give "' woman'" (quoted in the"""),
     (["addr", "{smol}", "cat"], "to use that, give ' cat'"),
     (["addr", "{smol}", "北京"], "the first ('\\xe5\\x8c', id 30158) is addressed"),
     (["lens", "{smol}", "The capital of France is", "--target", "Paris"],
      "note: --target 'Paris' is token 38634, but the model ranks ' Paris' (token 7042, with its "
      "leading space) higher at this position: to follow that, give --target ' Paris'")],
)  # fmt: skip
def test_words_are_said(cli, smollm2, args, says):
    result = cli(*(a.format(smol=smollm2) for a in args), "--json")
    assert result.exit_code == 0, result.stderr
    assert says in result.stderr, result.stderr
    assert json.loads(result.stdout)["command"] == args[0]


@pytest.mark.parametrize(
    "args",
    [["neighbors", "{smol}", " cat", "king"], ["addr", "{smol}", " cat", "42"],
     ["neighbors", "{tiny}", "king", "queen"], ["addr", "{tiny}", "king"]],
)  # fmt: skip
def test_words_that_are_what_they_seem_get_no_note(cli, tiny, smollm2, args):
    """' cat' is the word itself; 'king' (token 644) is a commoner piece than ' king' (4197); a
    word-level vocabulary has no leading spaces at all."""
    argv = [a.format(smol=smollm2, tiny=tiny("llama-tied")) for a in args]
    result = cli(*argv, "--json")
    assert result.exit_code == 0 and "note:" not in result.stderr, result.stderr


def test_the_targets_spaced_form_is_offered_only_where_the_model_prefers_it(cli, smollm2):
    """'Paris' is a rarer piece than ' Paris', but after '/wiki/' the model ranks the bare form
    higher (rank 22 against 1,694): no note there; after 'is' it prefers ' Paris' (above)."""
    prompt = "The French capital's page is https://en.wikipedia.org/wiki/"
    result = cli("lens", smollm2, prompt, "--target", "Paris", "--layers", "30", "--json")
    assert result.exit_code == 0 and "note:" not in result.stderr, result.stderr
    assert json.loads(result.stdout)["layers"][-1]["target"]["rank"] == 22


def test_a_target_of_byte_pieces_shows_each_bytes_escaped_once(cli, smollm2):
    err = cli.fails("lens", smollm2, "中国的首都是", "--target", "北京", code=2)
    assert "splits into 4 ('\\xe5\\x8c', '\\x97', '\\xe4\\xba', '\\xac')" in err, err


def test_a_target_that_splits_names_its_spaced_form(cli, smollm2):
    err = cli.fails("lens", smollm2, "The capital of France is", "--target", "queen", code=2)
    assert "hint: ' queen' with its leading space is one token (id 15731): --target ' queen'" in err


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_chat_template_that_loops_without_writing(cli, tiny, tmp_path, monkeypatch):
    """A template that loops and writes nothing is stopped by the time bound, not its size."""
    from embedlens.model import chat

    monkeypatch.setattr(chat, "SECONDS", 0.5)
    folder = tmp_path / "model"
    shutil.copytree(tiny("llama-tied"), folder)
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    (folder / "chat_template.jinja").write_text(loop)
    err = cli.fails("lens", folder, "the king", "--chat", "hello", code=1)
    assert f"'{folder / 'chat_template.jinja'}' is still rendering after 0.5 s" in err, err


HEADER_CASES = sorted(b for b in BROKEN if b.startswith(("st-", "gguf-", "shard-", "index-")))


def test_a_broken_file_is_refused_before_torch_or_transformers_is_imported(tiny, smollm2, tmp_path):
    """What a file's header tells (a truncated or corrupt safetensors or GGUF file, a missing
    shard) is refused by `lens` from embedlens' own reading, before torch or transformers is
    imported: a broken file is answered in well under a second, on any release."""
    import os
    import subprocess

    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root, "HF_HUB_OFFLINE": "1"}
    late = {}
    for broken in HEADER_CASES:
        work = tmp_path / broken
        work.mkdir()
        model = MAKERS[broken](work, tiny, smollm2)
        result = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "embedlens", "lens", str(model), "the king"],
            capture_output=True, text=True, env=env, cwd=work, timeout=120,
        )  # fmt: skip
        lines = [x for x in result.stderr.splitlines() if not x.startswith("import time:")]
        imported = {
            x.split("|")[-1].strip().split(".")[0]
            for x in result.stderr.splitlines()
            if x.startswith("import time:")
        }
        assert result.returncode == 1, (broken, result.stderr[-2000:])
        assert BROKEN[broken].format(model=model) in lines[0], (broken, lines)
        if imported & {"torch", "transformers"}:
            late[broken] = sorted(imported & {"torch", "transformers"})
    assert late == {}
