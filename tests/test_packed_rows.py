"""`neighbors`, `addr` and `vocab` on an embedding and head stored quantised (MLX, bitsandbytes).

The tiny model's tables are quantised here, laid out as MLX and bitsandbytes store them (MLX's
affine packing, LLM.int8's `SCB`, bitsandbytes' 4-bit nf4 with double-quantised absmax), and
each command's figures are checked against the matrix dequantised independently: a plain
transcription of each format's formula, value by value, written apart from embedlens'. Where
bitsandbytes is installed, its own dequantiser is the reference too.
"""

from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest

from tests.models import SPECIALS, WORDS

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
TOKENS = len(SPECIALS) + len(WORDS)
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
       -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
       0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
       0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]  # fmt: skip


def _mlx(w: np.ndarray, bits: int, group: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """MLX's affine quantisation of a [V, d] table, and its values read back one by one."""
    v, d = w.shape
    g = w.reshape(v, d // group, group)
    lo, hi = g.min(-1), g.max(-1)
    scales = ((hi - lo) / (2**bits - 1)).astype(np.float16)
    biases = lo.astype(np.float16)
    step = np.where(scales == 0, 1, scales).astype(np.float32)  # a constant group: q = 0
    q = np.clip(np.round((g - biases[..., None]) / step[..., None]), 0, 2**bits - 1)
    q = q.astype(np.int64).reshape(v, d)
    words = np.zeros((v, d * bits // 32), np.uint32)
    back = np.zeros((v, d), np.float32)
    for r in range(v):
        for j in range(d):  # value j: bits j*bits.. of the row, lowest bits of a word first
            words[r, j * bits // 32] |= np.uint32(int(q[r, j]) << (j * bits % 32))
            s, b = float(scales[r, j // group]), float(biases[r, j // group])
            back[r, j] = np.float32(q[r, j]) * np.float32(s) + np.float32(b)
    return {"weight": words, "scales": scales, "biases": biases}, back


def _bnb8(w: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
    scb = np.abs(w).max(1).astype(np.float32)
    q = np.round(w * 127 / np.where(scb == 0, 1, scb)[:, None]).astype(np.int8)
    back = (q.astype(np.float32) * scb[:, None]) * np.float32(7.874015718698502e-3)
    return {"weight": q, "SCB": scb}, back


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 rounded to bfloat16, to nearest even, one value at a time."""
    out = np.empty_like(x)
    for i, value in enumerate(x.reshape(-1)):
        (u,) = struct.unpack("<I", struct.pack("<f", value))
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        out.reshape(-1)[i] = struct.unpack("<f", struct.pack("<I", u))[0]
    return out


def _bnb4(w: np.ndarray, block: int = 64) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """bitsandbytes' nf4 with double quantisation: the flattened table in blocks, each scaled
    by its absmax; the absmax values quantised to uint8 in blocks of 256 about their mean."""
    code = np.asarray(NF4, np.float32)
    flat = w.reshape(-1)
    absmax = np.abs(flat.reshape(-1, block)).max(1).astype(np.float32)
    scaled = flat.reshape(-1, block) / np.where(absmax == 0, 1, absmax)[:, None]
    q = np.abs(scaled[..., None] - code).argmin(-1)
    q = q.reshape(-1).astype(np.uint8)
    packed = ((q[0::2] << 4) | q[1::2]).astype(np.uint8).reshape(-1, 1)
    offset = float(absmax.mean())
    nested_code = np.linspace(-1, 1, 256).astype(np.float32)
    nested_absmax = np.array([np.abs(absmax - offset).max()], np.float32)
    aq = np.abs((absmax - offset)[:, None] / nested_absmax[0] - nested_code).argmin(1)
    state = {"quant_type": "nf4", "blocksize": block, "dtype": "bfloat16", "shape": list(w.shape),
             "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": offset}  # fmt: skip
    tensors = {
        "weight": packed,
        "weight.absmax": aq.astype(np.uint8),
        "weight.quant_map": code,
        "weight.nested_absmax": nested_absmax,
        "weight.nested_quant_map": nested_code,
        "weight.quant_state.bitsandbytes__nf4": np.frombuffer(json.dumps(state).encode(), np.uint8),
    }
    back = np.empty(flat.size, np.float32)
    for i in range(flat.size):
        byte = int(packed[i // 2, 0])
        nibble = byte >> 4 if i % 2 == 0 else byte & 0xF
        a = np.float32(nested_code[aq[i // block]] * nested_absmax[0]) + np.float32(offset)
        back[i] = code[nibble] * a
    return tensors, _bf16(back).reshape(w.shape)


def _quantised(tiny, tmp_path, kind):
    """The untied tiny Llama with its embedding and head stored as `kind` stores them; the
    tables as read back independently."""
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / kind
    shutil.copytree(tiny("llama-untied"), folder)
    tensors = load_file(folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    lay = {"mlx": lambda w: _mlx(w, 4, 32), "mlx8": lambda w: _mlx(w, 8, 32), "bnb8": _bnb8,
           "bnb4": _bnb4}[kind]  # fmt: skip
    back = {}
    for name in (EMBED, HEAD):
        stored, back[name] = lay(tensors.pop(name).astype(np.float32))
        module = name.removesuffix(".weight")
        for key, value in stored.items():
            full = (
                name if key == "weight" else f"{module}.{key}" if kind != "bnb4" else name + key[6:]
            )
            tensors[full] = value
    if kind.startswith("mlx"):
        config["quantization"] = {"group_size": 32, "bits": 8 if kind == "mlx8" else 4}
    else:
        bits = {"load_in_8bit": True} if kind == "bnb8" else {"load_in_4bit": True}
        config["quantization_config"] = {"quant_method": "bitsandbytes", **bits}
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder, back


def _cosines(table: np.ndarray, row: int) -> np.ndarray:
    t = table.astype(np.float64)
    with np.errstate(invalid="ignore"):  # the zero row of '<pad>' has no cosine
        return t @ t[row] / (np.linalg.norm(t, axis=1) * np.linalg.norm(t[row]))


@pytest.mark.parametrize("kind", ["mlx", "mlx8", "bnb8", "bnb4"])
def test_neighbors_addr_vocab_on_a_quantised_table(cli, tiny, tmp_path, kind):
    folder, back = _quantised(tiny, tmp_path, kind)
    for matrix, name in (("input", EMBED), ("output", HEAD)):
        data = cli.json("neighbors", folder, "--id", "10", "--matrix", matrix, "-k", "5")
        found = data["queries"][0]["neighbors"]
        reference = _cosines(back[name], 10)
        searched = [i for i in range(len(SPECIALS), TOKENS) if i != 10]
        best = sorted(searched, key=lambda i: -reference[i])[:5]
        assert [n["id"] for n in found] == best, (kind, matrix)
        for n in found:
            assert n["cosine"] == pytest.approx(reference[n["id"]], rel=1e-5, abs=1e-6)
    got = cli.json("addr", folder, "0", "10", "71")
    assert got["check"]["all_equal"] is True and got["check"]["rows_checked"] == 3
    assert got["shape"] == list(back[EMBED].shape)
    from embedlens.io.source import resolve
    from embedlens.model.matrix import locate, open_rows

    source = resolve(str(folder))
    rows = open_rows(source, locate(source, "input"))
    assert np.array_equal(rows.take([0, 10, 71]), back[EMBED][[0, 10, 71]])
    assert np.array_equal(rows.block(0, back[EMBED].shape[0]), back[EMBED])
    for r, row in zip([0, 10, 71], got["rows"], strict=True):
        assert row["file_offset"] == got["tensor_file_offset"] + r * got["row_bytes"]
    row_bytes = {"mlx": 16, "mlx8": 32, "bnb8": 32, "bnb4": 16}[kind]  # d = 32
    assert got["row_bytes"] == row_bytes and got["rows"][1]["offset_bytes"] == 10 * row_bytes
    scaled = [n for n in got["notes"] if n.startswith("row 10 is scaled by")]
    said = {"mlx": ".scales'", "mlx8": ".biases'", "bnb8": ".SCB'", "bnb4": ".absmax'"}[kind]
    assert len(scaled) == 1 and said in scaled[0]
    vocab = cli.json("vocab", folder)
    layout = vocab["layout"]
    assert (layout["embedding_rows"], layout["head_rows"], layout["width"]) == (72, 72, 32)
    scan = vocab["undertrained"]
    for matrix, name in ((scan, HEAD), (scan["input"], EMBED)):
        norms = np.linalg.norm(back[name].astype(np.float64), axis=1)
        assert matrix["norms"] == pytest.approx(norms, abs=1e-6), (kind, name)


def test_bitsandbytes_own_dequantiser(tiny, tmp_path):
    """Files bitsandbytes itself wrote (nf4 and fp4, double-quantised; LLM.int8): every row as
    embedlens reads it equals bitsandbytes' own dequantised table. Blocks of 32, one a row:
    bitsandbytes' CPU kernel (0.50.2) reads a table whose rows are narrower than its blocks as
    if each row began a block, unlike its generic implementation and its quantiser (rows of 32
    in blocks of 64: 1,955 of 2,304 values differ, up to 1.9 from the table quantised, where
    the generic one and embedlens agree to the bit, within 0.39)."""
    torch = pytest.importorskip("torch")
    functional = pytest.importorskip("bitsandbytes.functional")
    from safetensors.numpy import save_file

    from embedlens.io.source import resolve
    from embedlens.model.matrix import locate, open_rows

    base = tiny("llama-tied")
    w = torch.randn(72, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for quant_type in ("nf4", "fp4", "int8"):
        folder = tmp_path / quant_type
        shutil.copytree(base, folder)
        config = json.loads((folder / "config.json").read_text())
        if quant_type == "int8":
            q, scb, _ = functional.int8_vectorwise_quant(w.half())
            theirs = functional.int8_vectorwise_dequant(q, scb).float().numpy()
            stored = {EMBED: q.numpy(), "model.embed_tokens.SCB": scb.numpy()}
            config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
        else:
            q, state = functional.quantize_4bit(
                w, blocksize=32, quant_type=quant_type, compress_statistics=True
            )
            theirs = functional.dequantize_4bit(q, state).float().numpy()
            stored = {EMBED: q.numpy()}
            for key, value in state.as_dict(packed=True).items():
                stored[f"{EMBED}.{key}"] = value.numpy()
            config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
        (folder / "config.json").write_text(json.dumps(config))
        save_file(stored | _rest(folder), folder / "model.safetensors")
        source = resolve(str(folder))
        rows = open_rows(source, locate(source, "input"))
        assert np.array_equal(rows.block(0, 72), theirs), quant_type


def _rest(folder):
    from safetensors.numpy import load_file

    return {k: v for k, v in load_file(folder / "model.safetensors").items() if k != EMBED}


def test_another_packed_table_is_refused(cli, tmp_path):
    """An embedding packed by compressed-tensors is not read as floats: one error names it."""
    from tests.quant_layouts import meta_shapes, pack_quantized, quantise, write_sparse
    from tests.test_params_quant import TINY

    quant = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"g": {"targets": ["Embedding"], "weights": {"num_bits": 4}}},
    }
    stored = quantise(meta_shapes(TINY), lambda n, s: n == EMBED, pack_quantized(4, 32))
    folder = tmp_path / "ct"
    write_sparse(folder, stored, {**TINY, "quantization_config": quant})
    for args in (("neighbors", folder, "--id", "3"), ("addr", folder, "3"), ("vocab", folder)):
        said = cli.fails(*args, code=1)
        assert f"'{EMBED}' is stored quantised (int4 (pack-quantized)" in said, (args, said)
        assert "(GGUF, MLX, bitsandbytes)" in said, args
