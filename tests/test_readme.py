"""README stays true: its SmolLM2 examples print what it shows, its test command is CI's."""

from __future__ import annotations

import importlib.util
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
# The self-check's float32 residue depends on the CPU's kernels (2.7e-05 on one machine, 5.7e-06
# on another); the line must still be there, with some value under the tolerance.
_RESIDUE = re.compile(r"max \|Δ\| = [0-9.e+-]+ ≤")


def _same_on_any_cpu(line: str) -> str:
    return _RESIDUE.sub("max |Δ| = … ≤", line.rstrip())


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
    for block in re.findall(r"```jsonl\n(.*?)```", README, flags=re.S):  # the prompts file shown
        (tmp_path / "facts.jsonl").write_text(block, encoding="utf-8")
    argv = shlex.split(command)
    code = "import sys; from embedlens.cli import main; sys.argv = sys.argv[1:]; main()"
    env = {**os.environ, "COLUMNS": "100", "EMBEDLENS_NO_COLOR": "1", "NO_COLOR": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code, *argv], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    printed = {_same_on_any_cpu(ln) for ln in (result.stdout + result.stderr).splitlines()}
    missing = [ln for ln in shown if _same_on_any_cpu(ln) not in printed]
    assert not missing, "\n".join(missing)


def test_readme_examples_were_found():
    commands = [c.split()[1] for c, _ in console_examples()]
    assert {"params", "tied", "neighbors", "addr", "lens", "vocab"} <= set(commands)


def _readme_commands():
    spec = importlib.util.spec_from_file_location(
        "readme_commands", ROOT / ".ci" / "readme_commands.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ci_runs_the_readme_commands():
    """CI reads both commands from README.md: the plain set-up first, then the test command."""
    found = _readme_commands().commands(README)
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    assert found["setup"] == blocks[0].strip()
    assert found["test"] == next(b.strip() for b in blocks if "pytest" in b)
    assert "pip install torch==2.13.0 -e . " in found["setup"]  # no extras
    assert "embedlens lens " in found["setup"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.index("readme_commands.py setup") < ci.index("readme_commands.py test")
    assert "python3 -m venv" in ci


def test_readme_commands_refuses_a_readme_without_them():
    with pytest.raises(ValueError, match="Set-up"):
        _readme_commands().commands("# embedlens\n\n```bash\npytest\n```\n")


def python_examples() -> list[str]:
    """README's ```python blocks (run on SmolLM2 in a folder that holds it)."""
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


@pytest.mark.slow
@pytest.mark.parametrize("block", python_examples(), ids=lambda b: b.splitlines()[0][:40])
def test_readme_python_example_gives_what_it_shows(block, smollm2, tmp_path, monkeypatch):
    """Each line ending in `# value` evaluates to that value; every other line runs."""
    import ast

    (tmp_path / SMOLLM2).symlink_to(smollm2)
    monkeypatch.chdir(tmp_path)
    scope: dict[str, object] = {}
    checked = 0
    for line in block.splitlines():
        code, _, shown = line.partition("  # ")
        if shown.strip() and not code.lstrip().startswith(("import", "from")):
            value = eval(code.strip(), scope)
            assert value == ast.literal_eval(shown.strip()), line
            checked += 1
        elif line.strip():
            exec(line, scope)
    assert checked >= 3


def test_readme_has_python_examples_for_every_command():
    text = "".join(python_examples())
    for name in ("params", "tied", "neighbors", "addr", "lens"):
        assert f"embedlens.{name}(" in text
