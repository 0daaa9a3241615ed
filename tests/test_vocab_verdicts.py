"""`vocab`'s verdicts as a script reads them: --check's exit status, unrelated vocabularies said
so, one count of unreachable tokens per tokenizer, and a --help that names its own options."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import typer
import typer.main

from tests.models import SPECIALS, TOKENIZER_LEN, WORDS


def _tokenizer_with(tiny, tmp_path: Path, order: list[str], name: str) -> Path:
    """The tiny WordLevel tokenizer with its vocabulary in `order` (specials first, as added)."""
    data = json.loads((tiny("llama-tied") / "tokenizer.json").read_text())
    data["model"]["vocab"] = {t: i for i, t in enumerate(order)}
    template = data["added_tokens"][0]
    data["added_tokens"] = [{**template, "id": order.index(t), "content": t} for t in SPECIALS]
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def inserted(tiny, tmp_path) -> Path:
    """Two words inserted after the 20th: every later id moved (a problem vocab reports)."""
    return _tokenizer_with(
        tiny, tmp_path, SPECIALS + WORDS[:20] + ["new1", "new2"] + WORDS[20:], "inserted.json"
    )


@pytest.fixture
def shuffled(tiny, tmp_path) -> Path:
    """The same words in another order: most ids differ, one by one."""
    words = list(WORDS)
    random.Random(0).shuffle(words)
    return _tokenizer_with(tiny, tmp_path, SPECIALS + words, "shuffled.json")


# --- an exit status for scripts -------------------------------------------------------------


def test_check_exits_3_when_a_problem_is_found(cli, tiny, inserted):
    folder = tiny("llama-tied")
    plain = cli("vocab", folder, "--against", inserted)
    assert plain.exit_code == 0 and "problem: " in plain.stdout  # without --check: 0
    checked = cli("vocab", folder, "--against", inserted, "--check")
    assert checked.exit_code == 3, checked.stderr
    assert checked.stdout == plain.stdout  # the report is printed whole first
    as_json = cli("vocab", folder, "--against", inserted, "--check", "--json")
    assert as_json.exit_code == 3 and json.loads(as_json.stdout)["problems"]


def test_check_exits_0_when_nothing_is_found(cli, tiny):
    result = cli("vocab", tiny("llama-tied"), "--check")
    assert result.exit_code == 0, result.stderr
    assert "No problem found" in result.stdout


def test_check_is_documented():
    errors = (Path(__file__).resolve().parent.parent / "docs" / "errors.md").read_text()
    assert "| 3 | `vocab --check`" in errors


# --- unrelated vocabularies -----------------------------------------------------------------


def test_unrelated_vocabularies_are_said_so_with_counts(cli, tiny, shuffled):
    data = cli.json("vocab", tiny("llama-tied"), "--against", shuffled)
    diff = data["against"]
    assert diff["unrelated"] and not diff["compatible"] and not diff["identical"]
    assert diff["shifts"] == []  # not one block per moved token
    common = diff["same_ids"] + diff["shifted"]
    assert common == TOKENIZER_LEN and diff["shifted"] > TOKENIZER_LEN // 2
    assert diff["summary"] == [
        f"'{shuffled}' is an unrelated vocabulary: of the {common} tokens both hold, "
        f"{diff['same_ids']} sit at the same id and {diff['shifted']} elsewhere, not in blocks; "
        "0 tokens here are not in it, 0 of its are not here"
    ]
    assert data["problems"] == diff["summary"]
    table = cli("vocab", tiny("llama-tied"), "--against", shuffled).stdout
    assert "UNRELATED" in table and "moved by" not in table


def test_a_shifted_block_is_still_related(cli, tiny, inserted):
    diff = cli.json("vocab", tiny("llama-tied"), "--against", inserted)["against"]
    assert not diff["unrelated"]
    assert diff["shifts"][0]["by"] == 2 and diff["shifts"][0]["count"] == TOKENIZER_LEN - 24


# --- one tokenizer, one answer --------------------------------------------------------------


def test_unreachable_tokens_are_the_tokenizers_whatever_the_weights(cli, tiny, smollm2):
    """SmolLM2's tokenizer checked against a 72-row model finds the 313 unreachable tokens that
    `vocab SmolLM2` finds, not just those below row 72."""
    own = cli.json("vocab", smollm2)["unreachable"]
    borrowed = cli.json("vocab", tiny("llama-tied"), "--tokenizer", smollm2)["unreachable"]
    assert own["count"] == borrowed["count"] == 313
    assert own == borrowed


# --- --help ---------------------------------------------------------------------------------


def test_every_option_a_help_names_is_an_option_of_that_command():
    from embedlens.cli import app

    root = typer.main.get_command(app)
    commands = getattr(root, "commands", {})
    assert "vocab" in commands
    for name, command in commands.items():
        text = command.get_help(typer.Context(command, info_name=name, terminal_width=200))
        has = {o for p in command.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
        # another command's option, named as such (`lens --tuned`, `$ embedlens lens ... --tuned`)
        # is not this command's
        others = "|".join(re.escape(c) for c in commands if c != name)
        text = re.sub(rf"\$ embedlens (?:{others}) .*", "", text)
        text = re.sub(rf"(?<![\w-])(?:{others}) --[a-z-]+", "", text)
        named = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*[a-z]", text))
        assert named <= has, (name, sorted(named - has))
