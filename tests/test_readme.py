"""README stays true: its SmolLM2 examples print what it shows, its test command is CI's."""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The self-check's float32 residue depends on the CPU's kernels (2.7e-05 on one machine, 5.7e-06
# on another); the line must still be there, with some value under the tolerance.
_RESIDUE = re.compile(r"max \|Δ\| = [0-9.e+-]+ ≤")
# A figure: digits with an optional sign, thousands commas, decimals, exponent.
_NUMBER = re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?(?![\w])")
# Table borders and runs of spaces: a figure one digit longer widens its whole column.
_FRAME = re.compile(r"[\s─━│┃┏┓┗┛┡┩┣┫╇┳┻╋├┤┼└┘┌┐╭╮╰╯┬┴╶╴]+")
AVX2 = {  # torch's, MKL's, oneDNN's and numpy's kernels as on a CPU without AVX-512
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "NPY_DISABLE_CPU_FEATURES": "AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL",
}


def _same_on_any_cpu(line: str) -> str:
    return _RESIDUE.sub("max |Δ| = … ≤", line.rstrip())


def _last_place(figure: str) -> float:
    """One unit in the last shown digit of a figure ('99.529' -> 0.001, '5.78e-31' -> 1e-33)."""
    mantissa, _, exponent = figure.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 10.0 ** (int(exponent or 0) - decimals)


def _parts(line: str) -> tuple[list[str], list[str]]:
    """A line's text between figures (frames and spacing folded) and its figures."""
    line = _same_on_any_cpu(line)
    return [_FRAME.sub(" ", t).strip() for t in _NUMBER.split(line)], _NUMBER.findall(line)


def _figure_agrees(shown: str, printed: str) -> bool:
    """Whole numbers (counts, ids, ranks of integers) exactly; a figure with decimals or an
    exponent within one unit in the last digit shown by either (README: "figures may differ in
    the last digit on other CPUs")."""
    exact = not any(c in s for s in (shown, printed) for c in ".eE")
    if exact:
        return shown == printed
    a, b = float(shown.replace(",", "")), float(printed.replace(",", ""))
    return abs(a - b) <= max(_last_place(shown), _last_place(printed)) * (1 + 1e-9)


def same_line(shown: str, printed: str) -> bool:
    """`printed` is README's `shown` up to float32 rounding on another CPU."""
    (shown_text, shown_figures), (text, figures) = _parts(shown), _parts(printed)
    return (
        shown_text == text
        and len(shown_figures) == len(figures)
        and all(_figure_agrees(a, b) for a, b in zip(shown_figures, figures, strict=True))
    )


def test_same_line_allows_the_last_digit_only():
    shown = "│  0 emb │    99.529 │   0.002 │  5.78e-31 │        5471 │     2e-15 │"
    assert same_line(shown, "│  0 emb │  99.530 │ 0.002 │ 5.77e-31 │ 5471 │ 2.01e-15 │")
    for changed in (
        "│  0 emb │    99.531 │   0.002 │  5.78e-31 │        5471 │     2e-15 │",  # 2 units off
        "│  0 emb │    99.529 │   0.002 │  5.78e-31 │        5472 │     2e-15 │",  # a count
        "│  0 emb │    99.529 │   0.002 │  5.78e-30 │        5471 │     2e-15 │",  # exponent
        "│  1 emb │    99.529 │   0.002 │  5.78e-31 │        5471 │     2e-15 │",  # a layer
    ):
        assert not same_line(shown, changed), changed
    assert not same_line("│ ' king' │ 0.5 │", "│ ' queen' │ 0.5 │")
    assert same_line("max |Δ| = 2.7e-05 ≤ 1e-3", "max |Δ| = 5.7e-06 ≤ 1e-3")


def console_examples() -> list[tuple[str, list[str]]]:
    """(command line, shown output lines) of each README console block run on SmolLM2."""
    examples = []
    for block in re.findall(r"```console\n(.*?)```", README, flags=re.S):
        lines = block.splitlines()
        if not lines[0].startswith("$ embedlens ") or "|" in lines[0] or SMOLLM2 not in lines[0]:
            continue
        examples.append((lines[0][2:], [ln.rstrip() for ln in lines[1:] if ln.strip() != "..."]))
    return examples


def readme_builds() -> dict[str, tuple[str, list[str]]]:
    """Files README's console blocks make with a script of this repository (`$ python bench/...
    IN OUT ...`): OUT -> (the command, the output shown)."""
    builds = {}
    for block in re.findall(r"```console\n(.*?)```", README, flags=re.S):
        lines = block.splitlines()
        if lines[0].startswith("$ python bench/"):
            builds[shlex.split(lines[0])[4]] = (lines[0][2:], [ln.rstrip() for ln in lines[1:]])
    return builds


@pytest.fixture(scope="session")
def readme_files(smollm2, tmp_path_factory) -> Callable[[str], Path]:
    """readme_files(name) -> the file README's build command makes, made once (it prints what
    README shows)."""
    folder = tmp_path_factory.mktemp("readme-files")
    (folder / SMOLLM2).symlink_to(smollm2)
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            command, shown = readme_builds()[name]
            argv = shlex.split(command)
            argv[:2] = [sys.executable, str(ROOT / argv[1])]
            result = subprocess.run(argv, cwd=folder, capture_output=True, text=True)
            assert result.returncode == 0, result.stderr
            assert_shows(shown, result.stdout + result.stderr)
            made[name] = folder / name
        return made[name]

    return make


def run_example(
    command: str,
    smollm2: Path,
    folder: Path,
    files: Callable[[str], Path] | None = None,
    **env: str,
) -> str:
    """The README command's stdout and stderr, run in `folder` beside SmolLM2, facts.jsonl and
    the files README's build commands make that it names (`files`)."""
    (folder / SMOLLM2).symlink_to(smollm2)
    for name in readme_builds():
        if name in command:
            assert files is not None, f"{command} needs {name}"
            (folder / name).symlink_to(files(name))
    for block in re.findall(r"```jsonl\n(.*?)```", README, flags=re.S):  # the prompts file shown
        (folder / "facts.jsonl").write_text(block, encoding="utf-8")
    argv = shlex.split(command)
    code = "import sys; from embedlens.cli import main; sys.argv = sys.argv[1:]; main()"
    env = {**os.environ, "COLUMNS": "100", "EMBEDLENS_NO_COLOR": "1", "NO_COLOR": "1", **env}
    result = subprocess.run(
        [sys.executable, "-c", code, *argv], cwd=folder, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr


def assert_shows(shown: list[str], output: str) -> None:
    printed = output.splitlines()
    missing = [ln for ln in shown if not any(same_line(ln, p) for p in printed)]
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("command, shown", console_examples(), ids=lambda x: str(x)[:60])
def test_readme_example_prints_what_it_shows(command, shown, smollm2, tmp_path, readme_files):
    assert_shows(shown, run_example(command, smollm2, tmp_path, readme_files))


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 kernels")
@pytest.mark.parametrize(
    "command, shown",
    [(c, s) for c, s in console_examples() if c.split()[1] == "lens"],
    ids=lambda x: str(x)[:60],
)
def test_readme_lens_examples_hold_with_avx2_kernels(
    command, shown, smollm2, tmp_path, readme_files
):
    """On a CPU without AVX-512 float32 sums land elsewhere (README's layer-0 KL of 99.529 is
    99.530 there; float64 says 99.5285): the stated tolerance covers both kernels."""
    assert_shows(shown, run_example(command, smollm2, tmp_path, readme_files, **AVX2))


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
    assert ci.index("readme_commands.py test") < ci.index("python -m tests.busy 3 python -m pytest")


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
