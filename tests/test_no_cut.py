"""No number or token is ever cut or wrapped: every command's output at 60, 80 and 120 columns
holds every figure and every token that the same output at 1,000 columns holds, whole; every lens
mode too (one prompt, --prompts, --against on a prompt and on prompts and with --site, --site,
--text, --states), and in a process of its own whose output goes to a pipe and to a file (what a
newcomer's `embedlens ... > out.txt` or `| less` meets).

A figure is a word holding a digit (a count, an id, a probability with its exponent, a size, a
`sha256:...` fingerprint, a file name with its numbers); a token is a token of the command's JSON
as the tables quote it ('\\x00', ' king' with its leading space). Wrapping prose at spaces moves
words and keeps them whole; cutting a figure (`3.0e-0…`), folding it (`16d5` / `b65f`) or breaking
a token at its leading space makes one of them disappear from the narrow output.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from embedlens.text import visible

WIDTHS = (60, 80, 120)
WIDE = 1000
# Table borders, and runs of spaces: what separates words in a table.
_FRAME = re.compile(r"[\s─━│┃┏┓┗┛┡┩┣┫╇┳┻╋├┤┼└┘┌┐╭╮╰╯┬┴╶╴╷╵]+")
PROMPTS = [
    {"prompt": "the king is a", "target": "queen", "id": "a"},
    {"prompt": "the cat and the", "target": "dog", "id": "b"},
]
SMOL_PROMPTS = [
    {"prompt": "The capital of France is", "target": " Paris", "id": "fr"},
    {"prompt": "The opposite of hot is", "target": " cold", "id": "hot"},
]


def figures(text: str) -> Counter[str]:
    """Every word of the output that holds a digit, counted."""
    return Counter(w for w in _FRAME.split(text) if any(c.isdigit() for c in w))


def tokens(data: Any) -> Iterator[str]:
    """Every token's text in a JSON value."""
    if isinstance(data, dict):
        for key, value in data.items():
            if key in ("token", "other_token") and isinstance(value, str):
                yield value
            else:
                yield from tokens(value)
    elif isinstance(data, list):
        for value in data:
            yield from tokens(value)


def _json(result: Any) -> list[Any]:
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def assert_nothing_cut(cli: Any, args: list[Any]) -> None:
    """The command's tables at every width hold the wide output's figures and tokens whole."""
    wide = cli(*args, env={"COLUMNS": str(WIDE)})
    assert wide.exit_code == 0, wide.stderr
    as_json = cli(*args, "--json")
    assert as_json.exit_code == 0, as_json.stderr
    quoted = {visible("'" + t + "'") for t in tokens(_json(as_json))}
    shown = {q: wide.stdout.count(q) for q in quoted if q in wide.stdout}
    summary = args[0] in ("params", "tied", "vocab") or "--prompts" in args or "--text" in args
    assert shown or summary, "no token of the JSON is shown"
    for width in WIDTHS:
        narrow = cli(*args, env={"COLUMNS": str(width)})
        assert narrow.exit_code == 0, narrow.stderr
        missing = figures(wide.stdout) - figures(narrow.stdout)
        assert not missing, (width, sorted(missing), narrow.stdout)
        broken = [q for q, n in shown.items() if narrow.stdout.count(q) < n]
        assert not broken, (width, broken, narrow.stdout)


def _prompts(tmp_path: Path, lines: list[dict[str, str]]) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return path


TINY = [
    ["params"],
    ["params", "--per-block"],
    ["tied"],
    ["neighbors", "king", "cat", "king - man + woman", "king queen", "--pool", "mean"],
    ["addr", "0", "king", "71", "--tokens", "16", "--tp", "8"],
    ["vocab"],
    ["lens", "the king is a", "--target", "queen"],
    ["lens", "the king is a", "--position", "all"],
]


@pytest.mark.parametrize("args", TINY, ids=lambda a: " ".join(a))
@pytest.mark.parametrize("family", ["llama-untied"])
def test_nothing_is_cut_on_a_tiny_model(cli, tiny, family, args):
    assert_nothing_cut(cli, [args[0], tiny(family), *args[1:]])


def test_nothing_is_cut_in_the_prompts_summary_of_a_tiny_model(cli, tiny, tmp_path):
    path = _prompts(tmp_path, PROMPTS)
    assert_nothing_cut(cli, ["lens", tiny("llama-untied"), "--prompts", path])


def test_nothing_is_cut_against_another_vocabulary(cli, tiny):
    other = tiny("llama-tied") / "tokenizer.json"
    assert_nothing_cut(cli, ["vocab", tiny("llama-untied"), "--against", other])


def lens_modes(tiny: Any, cli: Any, tmp_path: Path) -> dict[str, list[Any]]:
    """Every lens mode on a tiny model (B, for --against, shares its vocabulary)."""
    a, b = tiny("llama-untied"), tiny("llama-tied")
    prompts = _prompts(tmp_path, PROMPTS)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(["the king is a man and the queen is a woman"] * 8) + "\n", "utf-8")
    states = tmp_path / "states.safetensors"
    saved = cli("lens", a, "the king is a", "--save-states", states, "--json")
    assert saved.exit_code == 0, saved.stderr
    prompt = ["the king is a", "--target", "queen"]
    many_b = ["lens", a, "--prompts", prompts, "--against", b]
    return {
        "prompt": ["lens", a, *prompt, "-k", "3"],
        "prompts": ["lens", a, "--prompts", prompts],
        "against": ["lens", a, *prompt, "--against", b],
        "against-prompts": many_b,
        "against-prompts-site": [*many_b, "--site", "attn_out,resid_mid,resid"],
        "site": ["lens", a, *prompt, "--site", "resid,attn_out,mlp_out"],
        "text": ["lens", a, "--text", text, "--ctx", "16"],
        "text-against": ["lens", a, "--text", text, "--ctx", "16", "--against", b],
        "text-site": [
            "lens",
            a,
            "--text",
            text,
            "--ctx",
            "16",
            "--site",
            "attn_out,resid_mid,mlp_out,resid",
        ],
        "states": ["lens", a, "--states", states, "--target", "queen"],
        "parity": [
            "lens",
            a,
            *prompt[:1],
            "--dtype",
            "bfloat16",
            "--against-dtype",
            "float32",
            "--site",
            "attn_out,mlp_out",
        ],
        "parity-states": ["lens", a, "--against-states", states],
    }


MODES = [
    "prompt",
    "prompts",
    "against",
    "against-prompts",
    "against-prompts-site",
    "site",
    "text",
    "text-against",
    "text-site",
    "states",
    "parity",
    "parity-states",
]


@pytest.mark.parametrize("mode", MODES)
def test_nothing_is_cut_in_any_lens_mode(cli, tiny, tmp_path, mode):
    assert_nothing_cut(cli, lens_modes(tiny, cli, tmp_path)[mode])


# Runs each case in this one process, its stdout (file descriptor 1) a pipe or a file, at the
# width COLUMNS gives: argv[1] the cases as JSON, argv[2] where to write what each printed.
_SINKS = """\
import json, os, sys, tempfile, threading
from embedlens.cli import app
from embedlens.cli._scratch import make_scratch, remove_scratch
cases, out, printed = json.loads(sys.argv[1]), sys.argv[2], {}
for key, args, width, sink in cases:
    os.environ["COLUMNS"] = str(width)
    sys.stdout.flush()
    kept = os.dup(1)
    if sink == "file":
        path = tempfile.mktemp()
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    else:
        read, target = os.pipe()
        chunks = []
        reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: os.read(read, 65536), b"")))
        reader.start()
    os.dup2(target, 1)
    os.close(target)
    sys.argv = ["embedlens", *args]
    scratch = make_scratch()
    try:
        app()  # the entry point's body, without its os._exit at the end
    except SystemExit as e:
        assert not e.code, (key, e.code)
    finally:
        remove_scratch(scratch)
    sys.stdout.flush()
    os.dup2(kept, 1)
    os.close(kept)
    if sink == "file":
        with open(path, encoding="utf-8") as f:
            printed[key] = f.read()
        os.unlink(path)
    else:
        reader.join()
        os.close(read)
        printed[key] = b"".join(chunks).decode("utf-8")
with open(out, "w", encoding="utf-8") as f:
    json.dump(printed, f)
"""


def printed_to(cases: list[tuple[str, list[Any], int, str]], out: Path) -> dict[str, str]:
    """What each case printed with its stdout a pipe or a file, in a process of its own."""
    wire = json.dumps([(key, [str(a) for a in args], w, sink) for key, args, w, sink in cases])
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    done = subprocess.run(
        [sys.executable, "-c", _SINKS, wire, str(out)], capture_output=True, env=env, text=True
    )
    assert done.returncode == 0, done.stderr
    printed: dict[str, str] = json.loads(out.read_text(encoding="utf-8"))
    return printed


def test_nothing_is_cut_to_a_pipe_or_a_file(cli, tiny, tmp_path):
    """Every command and lens mode, its stdout a pipe and a file (no terminal) at each width."""
    model = tiny("llama-untied")
    runs = {" ".join(args): [args[0], model, *args[1:]] for args in TINY}
    runs.update(lens_modes(tiny, cli, tmp_path))
    cases = [
        (f"{name}|{width}|{sink}", args, width, sink)
        for name, args in runs.items()
        for width in WIDTHS
        for sink in ("pipe", "file")
    ]
    printed = printed_to(cases, tmp_path / "printed.json")
    for name, args in runs.items():
        wide = cli(*args, env={"COLUMNS": str(WIDE)})
        assert wide.exit_code == 0, wide.stderr
        quoted = {visible("'" + t + "'") for t in tokens(_json(cli(*args, "--json")))}
        shown = {q: wide.stdout.count(q) for q in quoted if q in wide.stdout}
        for width in WIDTHS:
            for sink in ("pipe", "file"):
                narrow = printed[f"{name}|{width}|{sink}"]
                missing = figures(wide.stdout) - figures(narrow)
                assert not missing, (name, width, sink, sorted(missing), narrow)
                broken = [q for q, n in shown.items() if narrow.count(q) < n]
                assert not broken, (name, width, sink, broken, narrow)


SMOL = [
    ["params"],
    ["tied"],
    ["neighbors", "' king'", "cat", "北京", "' king' - ' man' + ' woman'", "--id", "48047"],
    ["addr", "42", "' king'", "北京", "--tokens", "16384", "--tp", "4"],
    ["vocab"],
    ["lens", "The capital of France is", "--target", " Paris", "--layers", "0,8,16,24,28:"],
    ["lens", "The capital of France is", "--position", "all", "--layers", "0,28:"],
    ["lens", "The capital of France is", "--target", " Paris", "--against", "SMOL"],
]


@pytest.mark.parametrize("args", SMOL, ids=lambda a: " ".join(a))
def test_nothing_is_cut_on_smollm2(cli, smollm2, args):
    assert_nothing_cut(cli, [args[0], smollm2, *(smollm2 if a == "SMOL" else a for a in args[1:])])


def test_nothing_is_cut_in_the_prompts_summary_of_smollm2(cli, smollm2, tmp_path):
    path = _prompts(tmp_path, SMOL_PROMPTS)
    assert_nothing_cut(cli, ["lens", smollm2, "--prompts", path, "--layers", "0,8,16,24,28:"])


def _printed(renderable: Any, width: int) -> str:
    import io

    from rich.console import Console, Group

    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None).print(Group(renderable), crop=False)
    return buffer.getvalue()


def test_nothing_is_cut_in_the_tune_table_with_the_jacobian_lens(tiny, tmp_path):
    """The held-out table with its nine figures a layer (logit, tuned and Jacobian lenses) at
    every width holds the wide table's figures whole."""
    import io

    from rich.console import Console

    import embedlens
    from tests.test_tune import words_file

    report = embedlens.tune(
        tiny("llama-untied"),
        words_file(tmp_path / "w.txt"),
        tmp_path / "o",
        tokens=512,
        eval_tokens=128,
        method="affine",
        jacobian=True,
        estimator="sketch",
        probes=8,
        skip_first=2,
        jacobian_tokens=64,
    )

    def shown(width: int) -> str:
        out = io.StringIO()
        Console(file=out, width=width, no_color=True).print(report, crop=False)
        return out.getvalue()

    wide = shown(WIDE)
    assert "J KL" in wide
    for width in WIDTHS:
        missing = figures(wide) - figures(shown(width))
        assert not missing, (width, sorted(missing))


def test_words_break_between_tokens_never_inside_one():
    from embedlens.views.format import Words

    line = Words("Nearest to ").token(" InstancePreprocess").add(" - ").token(" transistorsum")
    for width in (10, 20, 30, 60):
        text = _printed(line, width)
        assert "' InstancePreprocess'" in text and "' transistorsum'" in text, text
    assert _printed(line, 60) == "Nearest to ' InstancePreprocess' - ' transistorsum'\n"
    assert _printed(Words("fingerprint: ").add("sha256:" + "0" * 64), 40).splitlines() == [
        "fingerprint:",
        "sha256:" + "0" * 64,  # longer than the line: whole on its own, never folded
    ]


def test_a_sheet_grows_rather_than_cut():
    from embedlens.views.format import Sheet, quoted

    table = Sheet()
    table.add_column("id", justify="right", no_wrap=True)
    table.add_column("token")
    table.add_column("offset", justify="right", no_wrap=True)
    table.add_row("48047", quoted(" InstancePreprocess"), "1,234,567,890")
    text = _printed(table, 30)
    assert "' InstancePreprocess'" in text and "1,234,567,890" in text and "…" not in text
