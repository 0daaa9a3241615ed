"""README stays true: its SmolLM2 examples print what it shows, its test command is CI's."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"


def console_examples() -> list[tuple[str, list[str]]]:
    """(command line, shown output lines) of each README console block run on SmolLM2."""
    examples = []
    for block in re.findall(r"```console\n(.*?)```", README, flags=re.S):
        lines = block.splitlines()
        if not lines[0].startswith("$ embedlens ") or "|" in lines[0] or SMOLLM2 not in lines[0]:
            continue
        examples.append((lines[0][2:], [ln.rstrip() for ln in lines[1:] if ln.strip() != "..."]))
    return examples


@pytest.mark.parametrize("command, shown", console_examples(), ids=lambda x: str(x)[:60])
def test_readme_example_prints_what_it_shows(command, shown, smollm2, tmp_path):
    (tmp_path / SMOLLM2).symlink_to(smollm2)
    argv = shlex.split(command)
    code = "import sys; from embedlens.cli import main; sys.argv = sys.argv[1:]; main()"
    env = {**os.environ, "COLUMNS": "100", "EMBEDLENS_NO_COLOR": "1", "NO_COLOR": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code, *argv], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    printed = {ln.rstrip() for ln in (result.stdout + result.stderr).splitlines()}
    missing = [ln for ln in shown if ln not in printed]
    assert not missing, "\n".join(missing)


def test_readme_examples_were_found():
    commands = [c.split()[1] for c, _ in console_examples()]
    assert {"params", "tied", "neighbors", "addr", "lens", "vocab"} <= set(commands)


def test_ci_runs_the_readme_test_command():
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    test_command = next(b.strip() for b in blocks if "pytest" in b)
    assert test_command in (ROOT / ".ci" / "run").read_text()
