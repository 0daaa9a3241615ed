"""README and docs/ stay true: their SmolLM2 examples print what they show, README's picture is
what the lens draws, and README's test command is CI's."""

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
PAGES = {
    "README.md": README,
    **{
        f"docs/{p.name}": p.read_text(encoding="utf-8")
        for p in sorted((ROOT / "docs").glob("*.md"))
    },
}
"""Every page whose examples the suite runs: README.md, then docs/*.md."""
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


FLOAT32_FLOOR = 5e-6
"""How far a fixed-point figure shown to 1e-06 or finer may move: such figures (`--text
--against`'s KL and perplexity tables, shown as llama-perplexity shows them) are computed from
float32 log-probabilities near -10, where float32's unit is 9.5e-07, and differences of them move
by a few units on another CPU (an AMD EPYC printed a mean PPL(Q)-PPL(base) of -0.004536 and a
99% KL of 0.007773 where an Intel Xeon prints -0.004533 and 0.007771)."""


def _figure_agrees(shown: str, printed: str) -> bool:
    """Whole numbers (counts, ids, ranks of integers) exactly; a figure with decimals or an
    exponent within one unit in the last digit shown by either (README: "figures may differ in
    the last digit on other CPUs"), a fixed-point one shown to 1e-06 or finer within
    FLOAT32_FLOOR."""
    exact = not any(c in s for s in (shown, printed) for c in ".eE")
    if exact:
        return shown == printed
    a, b = float(shown.replace(",", "")), float(printed.replace(",", ""))
    unit = max(_last_place(shown), _last_place(printed))
    fixed = not any(c in s for s in (shown, printed) for c in "eE")
    if fixed and unit <= 1e-6 * (1 + 1e-9):
        unit = FLOAT32_FLOOR
    return abs(a - b) <= unit * (1 + 1e-9)


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
    # shown to 1e-06: float32's rounding of the log-probabilities behind it, not one unit
    ppl = "Mean PPL(Q)-PPL(base)         :  -0.004533 ±   0.052940"
    assert same_line(ppl, "Mean PPL(Q)-PPL(base)         :  -0.004536 ±   0.052941")
    assert not same_line(ppl, "Mean PPL(Q)-PPL(base)         :  -0.004553 ±   0.052940")
    kl = "│     24 │ 0.000925 ± 0.000135 │ 0.000444 │ 0.002338 │ 0.007771 │"
    assert same_line(kl, "│     24 │ 0.000926 ± 0.000135 │ 0.000443 │ 0.002338 │ 0.007773 │")
    assert not same_line(kl, "│     24 │ 0.000925 ± 0.000135 │ 0.000444 │ 0.002338 │ 0.007781 │")
    assert not same_line("│ 0.00925 │", "│ 0.00927 │")  # 1e-05 and coarser: one unit
    assert same_line("max |Δ| = 2.7e-05 ≤ 1e-3", "max |Δ| = 5.7e-06 ≤ 1e-3")


def blocks(kind: str, pages: dict[str, str] = PAGES) -> list[str]:
    """The ```kind blocks of the pages, in order."""
    return [b for text in pages.values() for b in re.findall(rf"```{kind}\n(.*?)```", text, re.S)]


def shown_lines(lines: list[str]) -> list[str]:
    """A block's output lines: `...` stands for lines left out (each shown line must still be
    printed)."""
    return [ln.rstrip() for ln in lines if ln.strip() != "..."]


def console_examples(
    pages: dict[str, str] = PAGES, *, plots: bool = False
) -> list[tuple[str, list[str]]]:
    """(command line, shown output lines) of each console block run on SmolLM2, on any page; a
    command shown on several pages runs once, for the lines of every block. Commands that need
    the hub, a GPU or a pipe name no SmolLM2 file or hold a `|`, and are left out, as are those
    that draw a picture (`--plot`: test_readme_picture_is_what_the_lens_draws runs them) unless
    `plots`."""
    examples: dict[str, list[str]] = {}
    for block in blocks("console", pages):
        lines = block.splitlines()
        command = lines[0][2:]
        if not lines[0].startswith("$ embedlens ") or "|" in lines[0] or SMOLLM2 not in lines[0]:
            continue
        if ("--plot" in command) != plots:
            continue
        examples.setdefault(command, []).extend(shown_lines(lines[1:]))
    return list(examples.items())


def readme_builds() -> dict[str, tuple[str, list[str]]]:
    """Files the pages' console blocks make with a script of this repository (`$ python bench/...
    IN OUT ...`): OUT -> (the command, the output shown)."""
    builds = {}
    for block in blocks("console"):
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
    shown = set(blocks("jsonl"))  # the prompts file shown
    assert len(shown) <= 1, "the pages show more than one facts.jsonl"
    for block in shown:
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
    """README's tour runs every command but `tune` (minutes: a ```text block); so do the pages."""
    wanted = {"params", "tied", "neighbors", "addr", "lens", "vocab"}
    assert wanted <= {c.split()[1] for c, _ in console_examples({"README.md": README})}
    for name in wanted:
        page = {name: PAGES[f"docs/{name}.md"]}
        assert any(c.split()[1] == name for c, _ in console_examples(page)), name
    assert "$ embedlens tune SmolLM2" in README


def test_console_examples_merge_and_skip():
    pages = {
        "a": "```console\n$ embedlens x SmolLM2-135M-Instruct.Q4_1.gguf\nA\n...\nB\n```\n",
        "b": "```console\n$ embedlens x SmolLM2-135M-Instruct.Q4_1.gguf\nC\n```\n"
        "```console\n$ embedlens y Qwen/Qwen3-0.6B\nD\n```\n"
        "```console\n$ embedlens z SmolLM2-135M-Instruct.Q4_1.gguf --plot p.png\nE\n```\n",
    }
    assert console_examples(pages) == [("embedlens x SmolLM2-135M-Instruct.Q4_1.gguf", list("ABC"))]
    plots = console_examples(pages, plots=True)
    assert plots == [("embedlens z SmolLM2-135M-Instruct.Q4_1.gguf --plot p.png", ["E"])]


def test_readme_is_a_front_door():
    """Under 300 lines, with no dated measurement notes or load figures (docs/ and bench/ hold
    those)."""
    assert len(README.splitlines()) <= 300
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", README)
    assert "load average" not in README and not re.search(r"\bload \d", README)


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
    # the lowest releases' quick run starts with the newest releases' beside it (its load)
    newest = ci.index('"$work/newest/bin/python" "${quick[@]}") >')
    assert ci.index("readme_commands.py test") < newest < ci.index('lowest/bin/python" "${quick')


def test_the_tour_links_the_model_file_in_any_shell(smollm2, tmp_path):
    """The tour's link line finds the SmolLM2 file from the installed package alone (no SMOL
    left from the set-up's shell): run by bash in an empty folder with this environment's
    python first on PATH, it links the file there."""
    line = re.search(r"`(ln -s .*?SmolLM2-135M-Instruct\.Q4_1\.gguf\" \.)`", README)
    assert line is not None, "README's tour has no line that links the model file"
    assert "$SMOL" not in line.group(1)
    env = {k: v for k, v in os.environ.items() if k != "SMOL"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(["bash", "-c", line.group(1)], cwd=tmp_path, env=env, check=False)
    assert done.returncode == 0
    assert (tmp_path / SMOLLM2).resolve() == smollm2.resolve()


def test_readme_commands_refuses_a_readme_without_them():
    with pytest.raises(ValueError, match="Set-up"):
        _readme_commands().commands("# embedlens\n\n```bash\npytest\n```\n")


def readme_writes() -> dict[str, str]:
    """The pages' ```bash lines that write a file (`... > NAME`): command -> NAME."""
    found = {}
    for block in blocks("bash"):
        for line in block.splitlines():
            written = re.search(r" > ([\w.-]+)$", line)
            if written:
                found[line] = written.group(1)
    return found


def python_examples(pages: dict[str, str] = PAGES) -> list[str]:
    """The pages' ```python blocks (run on SmolLM2 in a folder that holds it)."""
    return blocks("python", pages)


@pytest.mark.slow
@pytest.mark.parametrize("block", python_examples(), ids=lambda b: b.splitlines()[0][:40])
def test_readme_python_example_gives_what_it_shows(block, smollm2, tmp_path, monkeypatch):
    """Each line ending in `# value` evaluates to that value; every other line runs. A block
    that imports a package not installed here (vLLM's recipe) is shown, not run."""
    import ast

    for node in ast.walk(ast.parse(block)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            if importlib.util.find_spec(name.split(".")[0]) is None:
                pytest.skip(f"needs {name.split('.')[0]}, not installed here")

    (tmp_path / SMOLLM2).symlink_to(smollm2)
    monkeypatch.chdir(tmp_path)
    for command, made in readme_writes().items():  # a text file README's commands write
        if f'"{made}"' in block:
            subprocess.run(["bash", "-c", command], cwd=tmp_path, check=True)
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
    for pages in ({"README.md": README}, {"python": PAGES["docs/python.md"]}):
        text = "".join(python_examples(pages))
        for name in ("params", "tied", "neighbors", "addr", "lens", "vocab"):
            assert f"embedlens.{name}(" in text, name


def pictures() -> list[tuple[str, list[str], Path]]:
    """(command, shown lines, the committed picture) of each README console block that draws
    `--plot NAME.png` where README shows docs/img/NAME.png."""
    found = []
    for command, shown in console_examples({"README.md": README}, plots=True):
        name = re.search(r"--plot (\S+\.png)", command)
        assert name and f"](docs/img/{name.group(1)})" in README, command
        found.append((command, shown, ROOT / "docs" / "img" / name.group(1)))
    return found


def picture_difference(a: Path, b: Path) -> tuple[float, float]:
    """(mean, largest) absolute difference between two PNGs' colours averaged over 16 x 16 pixel
    tiles (0 to 1): a cell's colour shows whole, while text drawn a pixel or two elsewhere by
    another matplotlib or FreeType (the whole image moved 2 pixels: 0.12 at most) averages out."""
    import matplotlib.image
    import numpy as np

    tiles = []
    for path in (a, b):
        pixels = matplotlib.image.imread(path)[..., :3]
        h, w = pixels.shape[0] // 16 * 16, pixels.shape[1] // 16 * 16
        tiles.append(pixels[:h, :w].reshape(h // 16, 16, w // 16, 16, 3).mean(axis=(1, 3)))
    assert tiles[0].shape == tiles[1].shape, "the pictures differ in size"
    diff = np.abs(tiles[0] - tiles[1])
    return float(diff.mean()), float(diff.max())


PICTURE_TOLERANCE = (0.02, 0.25)
"""(mean, largest) tile difference allowed between README's picture and the one drawn here."""


def test_picture_difference_tells_pictures_apart(tmp_path):
    """A cell recoloured, or the picture mirrored, is outside the tolerance; the same is 0."""
    pytest.importorskip("matplotlib")
    import matplotlib.image

    (_, _, committed), *_ = pictures()
    assert picture_difference(committed, committed) == (0.0, 0.0)
    pixels = matplotlib.image.imread(committed)
    changed = pixels.copy()
    changed[130:170, 850:930, :3] = changed[130:170, 850:930, :3] * 0.5 + 0.5
    matplotlib.image.imsave(tmp_path / "cell.png", changed)
    matplotlib.image.imsave(tmp_path / "mirror.png", pixels[:, ::-1])
    for other in ("cell.png", "mirror.png"):
        mean, largest = picture_difference(committed, tmp_path / other)
        assert mean > PICTURE_TOLERANCE[0] or largest > PICTURE_TOLERANCE[1], other


def test_readme_has_a_picture():
    assert len(pictures()) == 1


@pytest.mark.parametrize("command, shown, committed", pictures(), ids=lambda x: str(x)[:60])
def test_readme_picture_is_what_the_lens_draws(command, shown, committed, smollm2, tmp_path):
    """The lens draws README's picture again, here, within the tolerance (and prints what the
    block shows)."""
    pytest.importorskip("matplotlib")
    assert_shows(shown, run_example(command, smollm2, tmp_path))
    drawn = tmp_path / committed.name
    mean, largest = picture_difference(committed, drawn)
    assert mean <= PICTURE_TOLERANCE[0] and largest <= PICTURE_TOLERANCE[1], (mean, largest)
