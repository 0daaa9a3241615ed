"""No number or token is ever cut or wrapped: every command's output at 60, 80 and 120 columns
holds every figure and every token that the same output at 1,000 columns holds, whole.

A figure is a word holding a digit (a count, an id, a probability with its exponent, a size, a
`sha256:...` fingerprint, a file name with its numbers); a token is a token of the command's JSON
as the tables quote it ('\\x00', ' king' with its leading space). Wrapping prose at spaces moves
words and keeps them whole; cutting a figure (`3.0e-0…`), folding it (`16d5` / `b65f`) or breaking
a token at its leading space makes one of them disappear from the narrow output.
"""

from __future__ import annotations

import json
import re
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
    summary = args[0] in ("params", "tied", "vocab") or "--prompts" in args
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


SMOL = [
    ["params"],
    ["tied"],
    ["neighbors", "' king'", "cat", "北京", "' king' - ' man' + ' woman'", "--id", "48047"],
    ["addr", "42", "' king'", "北京", "--tokens", "16384", "--tp", "4"],
    ["vocab"],
    ["lens", "The capital of France is", "--target", " Paris", "--layers", "0,8,16,24,28:"],
    ["lens", "The capital of France is", "--position", "all", "--layers", "0,28:"],
]


@pytest.mark.parametrize("args", SMOL, ids=lambda a: " ".join(a))
def test_nothing_is_cut_on_smollm2(cli, smollm2, args):
    assert_nothing_cut(cli, [args[0], smollm2, *args[1:]])


def test_nothing_is_cut_in_the_prompts_summary_of_smollm2(cli, smollm2, tmp_path):
    path = _prompts(tmp_path, SMOL_PROMPTS)
    assert_nothing_cut(cli, ["lens", smollm2, "--prompts", path, "--layers", "0,8,16,24,28:"])


def _printed(renderable: Any, width: int) -> str:
    import io

    from rich.console import Console, Group

    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None).print(Group(renderable), crop=False)
    return buffer.getvalue()


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
