"""The lens's outputs in the modes bench/lens_outputs.py and bench/pair_outputs.py do not run
(--site, --tuned, --text, --save-states and --states, their combinations), to diff a change's.
Against a revision that refused a combination (`site-against-prompts`, `text-tuned-against`
before they ran), those cases differ.

    python bench/mode_outputs.py FIXTURES OUT                  # run every case, save
    python bench/mode_outputs.py FIXTURES OUT --against OLD    # ... then compare byte for byte

FIXTURES is built on the first run (two tiny models, each with a copy whose block 1 is changed
and a lens `tune` fitted to it, a text, prompts) and read by every later run, so that the runs
before and after a change read the same files: build it with the code before. A case that
saves states lists the SHA-256 of every states file OUT holds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.lens_outputs import compare, run_lens  # noqa: E402

FAMILIES = ("llama-tied", "gpt2")
PROMPTS = [
    {"prompt": "the king of France is", "target": "Paris", "id": "a"},
    {"prompt": "the capital city of Italy is Rome and the capital of Germany is"},
    {"prompt": "a big red", "target": "car"},
]
TEXT = " ".join(["the king of France is in Paris and the capital city of Italy is Rome"] * 30)


def fixtures(fix: Path) -> None:
    """Build FIXTURES once (its `done` file says it is complete)."""
    if (fix / "done").exists():
        return
    import embedlens
    from bench.pair_outputs import _changed_copy
    from tests.models import build
    from tests.test_tune import words_file

    fix.mkdir(parents=True, exist_ok=True)
    (fix / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    (fix / "text.txt").write_text(TEXT + "\n")
    for fam in FAMILIES:
        a = build(fam, fix / fam)
        _changed_copy(a, fix / f"{fam}-changed")
        embedlens.tune(
            a, words_file(fix / "w.txt"), fix / f"{fam}-lens", tokens=512, eval_tokens=128, steps=2
        )
    (fix / "done").write_text("")


def cases(fix: Path, fam: str, out: Path) -> dict[str, list[str]]:
    """name -> the arguments after `embedlens lens MODEL` (the states files written in `out`)."""
    f, t, lens, b = (
        fix / "prompts.jsonl",
        fix / "text.txt",
        fix / f"{fam}-lens",
        fix / f"{fam}-changed",
    )
    p = "the king of France is"
    s = out / f"{fam}.saved.safetensors"
    ss = out / f"{fam}.saved-sites.safetensors"
    lg = out / f"{fam}.logits.npz"
    vs_b = ["--against", str(b), "--json"]
    return {
        "site": [p, "--site", "attn_out", "--json"],
        "site-all": [p, "--site", "resid,resid_mid,attn_out,mlp_out", "--json", "-k", "3"],
        "site-table": [p, "--site", "resid_mid,mlp_out"],
        "site-prompts": ["--prompts", str(f), "--site", "attn_out,resid", "--json"],
        "site-against": [p, "--site", "attn_out", "--against", str(b), "--json"],
        "site-against-prompts": ["--prompts", str(f), "--site", "attn_out,resid", *vs_b],
        "tuned": [p, "--tuned", str(lens), "--json"],
        "tuned-table": [p, "--tuned", str(lens), "--target", "Paris"],
        "tuned-prompts": ["--prompts", str(f), "--tuned", str(lens), "--compare-logit", "--json"],
        "text": ["--text", str(t), "--ctx", "32", "--json"],
        "text-table": ["--text", str(t), "--ctx", "32"],
        "text-against": ["--text", str(t), "--ctx", "32", "--against", str(b), "--json"],
        "text-tuned": ["--text", str(t), "--ctx", "32", "--tuned", str(lens), "--json"],
        "text-tuned-against": ["--text", str(t), "--ctx", "32", "--tuned", str(lens), *vs_b],
        "save": [p, "--save-states", str(s), "--json"],
        "states": ["--states", str(s), "--json"],
        "states-table": ["--states", str(s), "--target", "Paris"],
        "states-tuned": ["--states", str(s), "--tuned", str(lens), "--json"],
        "save-sites": [p, "--site", "attn_out", "--save-states", str(ss), "--json"],
        "against-target": [p, "--against", str(b), "--target", "Paris", "--json"],
        "against-prompts-table": ["--prompts", str(f), "--against", str(b)],
        "states-sites": ["--states", str(ss), "--site", "attn_out", "--json"],
        "states-against": ["--states", str(s), *vs_b],
        "tuned-against": [p, "--tuned", str(lens), *vs_b],
        "text-site": ["--text", str(t), "--ctx", "32", "--site", "attn_out,resid", "--json"],
        "text-save-logits": ["--text", str(t), "--ctx", "32", "--save-logits", str(lg), "--json"],
        "text-against-logits": ["--text", str(t), "--ctx", "32", "--against-logits", str(lg)],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("fix", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--against", type=Path)
    ap.add_argument("--only")
    o = ap.parse_args()
    fixtures(o.fix)
    o.out.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        COLUMNS="200",
        PYTHONPATH=str(ROOT),
        EMBEDLENS_PROGRESS_SECONDS="0",
    )
    for fam in FAMILIES:
        for case, args in cases(o.fix, fam, o.out).items():
            if o.only and case not in o.only.split(","):
                continue
            text = run_lens([str(o.fix / fam), *args], env)
            text = text.replace(str(o.out), "OUT").replace(str(o.fix), "FIX")
            for saved in sorted(o.out.glob(f"{fam}.saved*.safetensors")):
                text += f"\n{saved.name} {hashlib.sha256(saved.read_bytes()).hexdigest()}"
            (o.out / f"{fam}.{case}.txt").write_text(text)
            print(fam, case, text.splitlines()[0], flush=True)
    return compare(o.out, o.against)


if __name__ == "__main__":
    raise SystemExit(main())
