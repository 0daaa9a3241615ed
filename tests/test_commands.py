"""Every command the CLI has is whole: a library function in `embedlens.__all__`, a working
`--help` that names its docs page, a `--json` option and a page in docs/ that README links to. The commands are read from the Typer app, so a
command added without one of them fails here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer
import typer.main

import embedlens
from embedlens.cli import app

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def commands(typer_app: typer.Typer) -> dict[str, Any]:
    """The app's commands by name, as the command line sees them (Click's commands)."""
    group = typer.main.get_command(typer_app)
    found: dict[str, Any] = getattr(group, "commands", {})
    return found


def problems(name: str, command: Any, *, readme: str = README) -> list[str]:
    """What a command lacks of the four (empty: nothing)."""
    found = []
    fn = getattr(embedlens, name, None) if name in embedlens.__all__ else None
    if not callable(fn) or getattr(fn, "__name__", None) != name:
        found.append(f"{name}: no library function embedlens.{name} in embedlens.__all__")
    options = {opt for param in command.params for opt in getattr(param, "opts", [])}
    if "--json" not in options:
        found.append(f"{name}: no --json option")
    page = ROOT / "docs" / f"{name}.md"
    heading = page.is_file() and re.match(
        rf"# `embedlens {re.escape(name)}`", page.read_text(encoding="utf-8")
    )
    if not heading or f"](docs/{name}.md)" not in readme:
        found.append(f"{name}: no page docs/{name}.md ('# `embedlens {name}`') linked from README")
    return found


APP_COMMANDS = commands(app)


def test_the_app_has_the_commands_it_is_known_for():
    """The list below is read from the app; this only checks that reading it works."""
    assert {"params", "tied", "neighbors", "addr", "lens", "vocab"} <= set(APP_COMMANDS)


@pytest.mark.parametrize("name", sorted(APP_COMMANDS))
def test_every_command_has_a_function_json_and_a_docs_page(name):
    assert problems(name, APP_COMMANDS[name]) == []


@pytest.mark.parametrize("name", sorted(APP_COMMANDS))
def test_every_command_has_help(name, cli):
    result = cli(name, "--help")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith(f"Usage: embedlens {name} ")
    assert "--json" in result.stdout and "Examples:" in result.stdout
    assert result.stdout.rstrip().endswith(f"Reference: docs/{name}.md")
    assert (ROOT / "docs" / f"{name}.md").is_file()
    assert result.stderr == ""


@pytest.mark.parametrize("name", sorted(APP_COMMANDS))
def test_help_never_breaks_an_option_name(name, cli):
    """At 80 columns every option name the help mentions is whole on its line: a line is never
    broken at a hyphen (`--chat-` / `template`), only at spaces."""
    result = cli(name, "--help", env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.stderr
    broken = [line for line in result.stdout.splitlines() if re.search(r"\w-$", line.rstrip())]
    assert not broken, broken


def test_an_option_without_its_value_points_to_the_command_s_help(cli, tiny):
    said = cli.fails("lens", tiny("llama-tied"), "the king", "--target", code=2)
    assert "requires an argument" in said and "hint: see 'embedlens lens --help'" in said
    said = cli.fails("neighbors", tiny("llama-tied"), "king", "-k", code=2)
    assert "hint: see 'embedlens neighbors --help'" in said


def test_every_library_command_is_a_cli_command():
    """The other way round: no command function in embedlens.__all__ lacks its command
    (`lens_prompts` is `lens --prompts`, `lens_states` `lens --states`, `lens_text` `lens
    --text`)."""
    functions = {n for n in embedlens.__all__ if n.islower() and not n.startswith("_")}
    modes = {"lens_prompts": "lens", "lens_states": "lens", "lens_text": "lens"}
    modes["lens_parity"] = "lens"
    assert {modes.get(name, name) for name in functions} == set(APP_COMMANDS)


def test_a_command_missing_each_part_is_caught():
    """A command registered without a library function, --json or a docs page is named
    three times: the checks above would fail on it."""
    extra = typer.Typer()

    @extra.command()
    def bogus(model: str) -> None:
        """A command with none of the parts."""

    @extra.command()
    def other(model: str) -> None:
        """A second, so that Typer keeps a group."""

    found = problems("bogus", commands(extra)["bogus"])
    assert len(found) == 3, found
    assert problems("params", APP_COMMANDS["params"], readme="") == [
        "params: no page docs/params.md ('# `embedlens params`') linked from README"
    ]


def test_lens_help_groups_its_options_in_panels(cli):
    """`lens --help`: every option under its panel (typer's rich_help_panel), the panels in
    order; only --help itself is left under 'Options'."""
    import re

    from embedlens.cli import PANELS

    out = cli("lens", "--help").stdout
    sections = re.findall(r"^([A-Z][a-z]+):$", out, flags=re.M)
    assert sections == ["Arguments", *PANELS, "Options"]
    rest = out.split("\nOptions:\n", 1)[1].split("\n\n", 1)[0]
    assert re.findall(r"^  (-\S+)", rest, flags=re.M) == ["-h,"]
    for flag in ("--text", "--site", "--tuned", "--against", "--json", "--dtype", "--quiet"):
        assert re.search(rf"^  (-\w, )?{flag}\b", out, flags=re.M), flag
