"""Progress on stderr: animated on a terminal; off one (CI logs, nohup, a notebook's `!embedlens`)
plain lines every few seconds of a long wait; never with --quiet."""

from __future__ import annotations

import io
import re
import time

import pytest
from rich.console import Console

from embedlens.cli import _output

LONG = "/a/very/long/path/to/some/model/folder/that/fills/a/line/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def fast(monkeypatch):
    """Plain progress lines every 50 ms instead of every few seconds; not quiet."""
    monkeypatch.delenv("EMBEDLENS_PROGRESS_SECONDS")
    monkeypatch.setattr(_output, "PLAIN_EVERY", 0.05)
    monkeypatch.setitem(_output._state, "quiet", False)


def _plain_lines(err: str) -> list[str]:
    assert "\x1b" not in err and "\r" not in err  # no animation, no escape sequences
    return err.splitlines()


def test_a_wait_off_a_terminal_prints_plain_lines(fast, capsys):
    assert not _output.err_console.is_terminal
    with _output.progress("Reading m"):
        time.sleep(0.4)
    lines = _plain_lines(capsys.readouterr().err)
    assert 3 <= len(lines) <= 9, lines
    assert all(re.fullmatch(r"Reading m: 0:00", line) for line in lines), lines


def test_counted_work_off_a_terminal_says_its_count_first(fast, capsys):
    with _output.counter(f"Running the lens on {LONG}", "prompts") as advance:
        for _ in range(3):
            advance()
        time.sleep(0.2)
    lines = _plain_lines(capsys.readouterr().err)
    assert lines and all(line.startswith("3 prompts done, ") for line in lines), lines
    assert lines[-1].endswith(f": Running the lens on {LONG}")


def test_bytes_off_a_terminal(fast, capsys):
    with _output.byte_bar("reading model.safetensors", 4 << 20) as received:
        received(1 << 20)
        time.sleep(0.2)
    lines = _plain_lines(capsys.readouterr().err)
    assert lines and lines[-1].startswith("reading model.safetensors: 1.00 MiB of 4.00 MiB (25%)")


def test_work_done_sooner_prints_nothing(capsys, monkeypatch):
    monkeypatch.setitem(_output._state, "quiet", False)
    with _output.progress("Reading m"):
        time.sleep(0.05)
    assert capsys.readouterr().err == ""


def test_quiet_hides_plain_progress(fast, capsys):
    _output.set_quiet(True)
    with _output.progress("Reading m"), _output.counter("Running", "prompts") as advance:
        advance()
        time.sleep(0.3)
    assert capsys.readouterr().err == ""


def test_lens_prompts_off_a_terminal_and_quiet(cli, tiny, tmp_path, monkeypatch):
    """The command as a CI log sees it: plain lines with the count; with --quiet, none."""
    monkeypatch.delenv("EMBEDLENS_PROGRESS_SECONDS")
    monkeypatch.setattr(_output, "PLAIN_EVERY", 0.01)
    prompts = tmp_path / "p.txt"
    prompts.write_text("the king\n" * 40, encoding="utf-8")
    result = cli("lens", tiny("llama-tied"), "--prompts", prompts)
    assert result.exit_code == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if " prompts done, " in line]
    assert said and all("Running the lens on " in line for line in said), result.stderr
    quiet = cli("lens", tiny("llama-tied"), "--prompts", prompts, "--quiet")
    assert quiet.exit_code == 0 and quiet.stderr == ""


def test_the_count_is_not_hidden_by_a_long_path_on_a_terminal(monkeypatch):
    """On an 80-column terminal the prompts' count and rate come before the model's path."""
    buffer = io.StringIO()
    terminal = Console(file=buffer, force_terminal=True, width=80, color_system=None)
    monkeypatch.setattr(_output, "err_console", terminal)
    monkeypatch.setitem(_output._state, "quiet", False)
    with _output.counter(f"Running the lens on {LONG}", "prompts") as advance:
        for _ in range(12):
            advance()
        time.sleep(0.3)  # Rich redraws a few times a second
    assert "12 prompts" in buffer.getvalue()


def test_tune_off_a_terminal_says_its_phase(cli, tiny, tmp_path, monkeypatch):
    """`tune` runs for minutes: off a terminal its lines name the phase and how far it got."""
    from tests.test_tune import SMALL, words_file

    monkeypatch.delenv("EMBEDLENS_PROGRESS_SECONDS")
    monkeypatch.setattr(_output, "PLAIN_EVERY", 0.01)
    data = words_file(tmp_path / "words.txt")
    result = cli("tune", tiny("llama-tied"), "--data", data, "--out", tmp_path / "lens", *SMALL)
    assert result.exit_code == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if ": Tuning a lens on " in line]
    assert said, result.stderr
    phases = {line.split(" ", 1)[0] for line in said}
    assert phases & {"fitting", "refining", "evaluating"}, said
    assert all(re.match(r"\w+ [\d,]+/[\d,]+", line) for line in said if line[0] != "l"), said


def test_json_off_a_terminal_imports_no_rich(smollm2):
    """`vocab --json` with stderr no terminal shows nothing through Rich, so never imports it
    (a thirtieth of its time on a 262k vocabulary); the tables and an error line still do."""
    import json

    from tests.test_chat_template import _imports_of

    def rich(imported: set[str]) -> set[str]:
        return {m for m in imported if m == "rich" or m.startswith("rich.")}

    result, imported, _ = _imports_of("vocab", smollm2, "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["command"] == "vocab"
    assert not rich(imported)
    result, imported, _ = _imports_of("vocab", smollm2)
    assert result.returncode == 0 and "Vocabulary" in result.stdout
    assert "rich.console" in imported
    result, imported, said = _imports_of("vocab", smollm2.parent / "missing.gguf", "--json")
    assert result.returncode != 0 and said[0].startswith("error: ")


def test_consoles_made_late_take_their_sizes_from_import(monkeypatch):
    """The consoles are made when first asked for, yet as if at import: COLUMNS unset then, the
    width follows COLUMNS at every use (a test's run sets its own); set then, it stays."""
    monkeypatch.setattr(_output, "_made", {})
    monkeypatch.setattr(_output, "_SIZE_AT_IMPORT", (None, None))
    monkeypatch.setenv("COLUMNS", "77")
    assert _output.console.width == 77 and _output.err_console.width == 77
    monkeypatch.setenv("COLUMNS", "123")
    assert _output.console.width == 123 and _output.err_console.width == 123
    monkeypatch.setattr(_output, "_SIZE_AT_IMPORT", ("90", "30"))
    assert _output.console.width == 90 and _output.console.height == 30
    monkeypatch.setenv("COLUMNS", "55")
    monkeypatch.setenv("LINES", "12")
    assert _output.err_console.width == 90 and _output.err_console.height == 30
    made = _output.console
    assert _output.console is made  # the same sizes: the same consoles
    monkeypatch.delenv("COLUMNS")
    monkeypatch.delenv("LINES")
    monkeypatch.setattr(_output, "_SIZE_AT_IMPORT", (None, None))
    assert _output.console.width == Console().width  # neither set: what Rich finds itself
