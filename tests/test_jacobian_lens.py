"""The Jacobian lens as a decoder (`lens --jacobian`, `embedlens.JacobianLens`): its artifact read
safely and checked against the model, and its reading, W_U norm(J_l h), computed independently
here from the model's own final norm and head (plain torch) on transformers' hidden states.

The artifact is the reference's format (TransformerLens writes the same): `J` maps artifact layer
l (block l's output, embedlens' layer l + 1) to a float16 matrix; layers without a matrix are
read through the identity."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import embedlens
from embedlens.analysis.lens.jacobian import Transport, open_jacobian, write_artifact
from tests.hubserver import FakeHub, Repo
from tests.test_hub_failures import run
from tests.test_lens_decoders import _hidden, _loaded

PROMPT = "the king of France is"


def _artifact(model: Path, path: Path, seed: int = 0, **metadata: Any) -> dict[int, torch.Tensor]:
    """Matrices near the identity for every block but the last, written to `path`; returned as
    float16 rounds them (what a reader gets)."""
    sized = embedlens.params(model, meta_only=True)
    d, n = sized.hidden_size, sized.num_layers
    g = torch.Generator().manual_seed(seed)
    matrices = {i: torch.eye(d) + 0.1 * torch.randn(d, d, generator=g) for i in range(n - 1)}
    write_artifact(path, matrices, n_prompts=7, metadata={"target_layer": n - 1, **metadata})
    return {i: m.half().float() for i, m in matrices.items()}


def _plain_logits(model: Any, h: torch.Tensor) -> torch.Tensor:
    """The model's final norm then head on h (llama's and gpt2's layout), float32."""
    inner = getattr(model, "model", None) or model.transformer
    norm = getattr(inner, "norm", None) or inner.ln_f
    with torch.no_grad():
        return model.lm_head(norm(h)).float()


@pytest.mark.parametrize("family", ["llama-tied", "gpt2"])
def test_the_report_is_the_head_on_j_times_h(tiny, tmp_path, family):
    folder = tiny(family)
    matrices = _artifact(folder, tmp_path / "j.pt")
    model, tok = _loaded(folder)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    report = embedlens.lens(folder, PROMPT, jacobian=tmp_path / "j.pt", top_k=4).to_dict()
    assert report["jacobian"] == {
        "path": str(tmp_path / "j.pt"),
        "made_by": "jacobian-lens",
        "model_name": "",
        "n_prompts": 7,
        "layers": [i + 1 for i in sorted(matrices)],
    }
    hidden = _hidden(model, ids)
    for row in report["layers"]:
        layer = row["layer"]
        h = hidden[layer][0, -1]
        if layer - 1 in matrices:
            h = matrices[layer - 1] @ h
        logits = _plain_logits(model, h)
        probs = torch.softmax(logits.double(), -1)
        top = torch.topk(logits[: len(tok)], 4).indices.tolist()
        assert [t["id"] for t in row["top"]] == top, layer
        for t in row["top"]:
            assert t["prob"] == pytest.approx(float(probs[t["id"]]), rel=1e-4, abs=1e-7)
    # the public decoder on the same hidden states gives the same logits
    decoder = embedlens.JacobianLens.from_file(model, tmp_path / "j.pt")
    for layer in range(len(hidden)):
        h = hidden[layer][0, -1]
        expected = _plain_logits(model, matrices[layer - 1] @ h if layer - 1 in matrices else h)
        assert torch.allclose(decoder(hidden[layer], layer)[0, -1], expected, atol=1e-4), layer


def test_the_identity_is_the_logit_lens(tiny, tmp_path):
    folder = tiny("llama-tied")
    sized = embedlens.params(folder, meta_only=True)
    d, n = sized.hidden_size, sized.num_layers
    eye = {i: torch.eye(d) for i in range(n - 1)}
    write_artifact(tmp_path / "eye.pt", eye, n_prompts=1, metadata={})
    through = embedlens.lens(folder, PROMPT, jacobian=tmp_path / "eye.pt", position="all")
    plain = embedlens.lens(folder, PROMPT, position="all")
    assert through.layers == plain.layers and through.grid == plain.grid
    assert through.check == plain.check


def test_a_reference_fit_checkpoint_reads_as_its_means(tiny, tmp_path):
    folder = tiny("llama-tied")
    matrices = _artifact(folder, tmp_path / "j.pt")
    sums = {i: 4 * m for i, m in matrices.items()}
    torch.save(
        {
            "jacobian_sum": sums,
            "n_done": 4,
            "next_idx": 4,
            "source_layers": list(sums),
            "target_layer": len(sums),
            "skip_first": 16,
        },
        tmp_path / "ckpt.pt",
    )
    from_ckpt = embedlens.lens(folder, PROMPT, jacobian=tmp_path / "ckpt.pt", top_k=3)
    from_file = embedlens.lens(folder, PROMPT, jacobian=tmp_path / "j.pt", top_k=3)
    assert [r.top for r in from_ckpt.layers] == [r.top for r in from_file.layers]
    assert from_ckpt.jacobian is not None and from_ckpt.jacobian.n_prompts == 4


def test_only_the_layers_decoded_are_read(tiny, tmp_path):
    folder = tiny("llama-tied")
    _artifact(folder, tmp_path / "j.pt")
    lens = open_jacobian(tmp_path / "j.pt")
    transport = Transport(lens)
    rows = torch.randn(3, lens.d_model)
    out = transport.apply(rows, [0, 2, 2])
    assert set(transport._read) == {2}  # layer 1's matrix was never read from the file
    assert torch.equal(out[0], rows[0])  # layer 0 (the embedding output): the identity


def test_a_folder_holding_one_artifact_and_the_hub_by_range(tiny, tmp_path):
    folder = tiny("llama-tied")
    (tmp_path / "lens").mkdir()
    _artifact(folder, tmp_path / "lens" / "j.pt")
    by_file = embedlens.lens(folder, PROMPT, jacobian=tmp_path / "lens" / "j.pt").to_dict()
    by_folder = embedlens.lens(folder, PROMPT, jacobian=tmp_path / "lens").to_dict()
    assert by_folder["layers"] == by_file["layers"]
    data = (tmp_path / "lens" / "j.pt").read_bytes()
    args = ["lens", str(folder), PROMPT, "--jacobian", "org/jlens:j.pt", "--json"]
    with FakeHub() as hub:
        hub.repos["org/jlens"] = Repo("ok", {"j.pt": data})
        done = run(hub.url, tmp_path / "home", *args, "--layers", "0,1")
        everything = run(hub.url, tmp_path / "home2", *args)
    assert done.returncode == 0 and everything.returncode == 0, done.stderr + everything.stderr
    from_hub = json.loads(everything.stdout)
    assert from_hub["layers"] == by_file["layers"]
    assert from_hub["jacobian"]["path"] == "org/jlens:j.pt"
    for row, alone in zip(json.loads(done.stdout)["layers"], by_file["layers"][:2], strict=True):
        assert [t["id"] for t in row["top"]] == [t["id"] for t in alone["top"]]
        for t, u in zip(row["top"], alone["top"], strict=True):  # other rows beside: rounding
            assert t["prob"] == pytest.approx(u["prob"], rel=1e-5)


def test_by_range_only_the_matrices_read_are_fetched(tmp_path):
    from embedlens.io.torchzip import RangeFile, read_payload

    d = 1024  # 2 MiB a float16 matrix: more than a block of the zip's small reads
    write_artifact(
        tmp_path / "big.pt", {i: torch.eye(d) for i in range(3)}, n_prompts=1, metadata={}
    )
    data = (tmp_path / "big.pt").read_bytes()
    fetched: list[int] = []

    def read(start: int, stop: int) -> bytes:
        fetched.append(stop - start)
        return data[start:stop]

    import io

    payload = read_payload(io.BufferedReader(RangeFile(len(data), read)), "big.pt")
    before = sum(fetched)
    assert before <= 2 << 16  # the directory and the pickle: two blocks of 64 KiB at most
    assert torch.equal(payload["J"][1].load(), torch.eye(d).half())
    assert sum(fetched) - before <= 2 * d * d + (2 << 16)  # one matrix, and a block each side


def test_the_torch_zip_reader_gives_what_torch_load_gives(tmp_path):
    from embedlens.io.torchzip import read_payload

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    saved = {
        "J": {0: base.half(), 3: base.T.contiguous().bfloat16(), 5: base[:, 1:4]},
        "n": 3,
        "meta": {"a": [1, 2.5, None, True, "x"], "t": (1, 2)},
    }
    torch.save(saved, tmp_path / "x.pt")
    with open(tmp_path / "x.pt", "rb") as f:
        lazy = read_payload(f, "x.pt")
        assert lazy["n"] == 3 and lazy["meta"] == saved["meta"]
        for key, tensor in saved["J"].items():
            got = lazy["J"][key].load()
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), key


class _Runs:
    """A pickle that would run code when loaded."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch pwned",))


def test_bad_artifacts_are_refused_with_one_line(tiny, tmp_path, cli, monkeypatch):
    folder = tiny("llama-tied")
    monkeypatch.chdir(tmp_path)
    sized = embedlens.params(folder, meta_only=True)
    d, n = sized.hidden_size, sized.num_layers
    bad = {
        "code.pt": ({"J": {0: _Runs()}}, "not a plain file of tensors"),
        "noj.pt": ({"W": {0: torch.eye(d)}}, "holds no 'J'"),
        "shape.pt": (
            {"J": {0: torch.eye(d + 1)}, "d_model": d + 1, "n_prompts": 1},
            "this model's residual stream is",
        ),
        "ragged.pt": (
            {"J": {0: torch.eye(d), 1: torch.eye(3)}, "n_prompts": 1},
            "every matrix must be d_model x d_model",
        ),
        "deep.pt": (
            {"J": {n - 1: torch.eye(d)}, "d_model": d, "n_prompts": 1},
            f"this model has {n} blocks",
        ),
        "target.pt": (
            {
                "J": {0: torch.eye(d)},
                "d_model": d,
                "n_prompts": 1,
                "metadata": {"target_layer": n + 3},
            },
            "was fitted to block",
        ),
    }
    for name, (payload, said) in bad.items():
        torch.save(payload, tmp_path / name)
        code = 2 if name in ("shape.pt", "deep.pt", "target.pt") else 1  # another model: usage
        err = cli.fails("lens", folder, PROMPT, "--jacobian", tmp_path / name, code=code)
        assert said in err, (name, err)
    assert not (tmp_path / "pwned").exists()
    (tmp_path / "text.pt").write_bytes(pickle.dumps("not torch"))
    cli.fails("lens", folder, PROMPT, "--jacobian", tmp_path / "text.pt", code=1)
    (tmp_path / "two").mkdir()
    for name in ("a.pt", "b.pt"):
        (tmp_path / "two" / name).write_bytes((tmp_path / "shape.pt").read_bytes())
    assert "holds 2 .pt files" in cli.fails("lens", folder, PROMPT, "--jacobian", "two", code=2)
    assert "does not exist" in cli.fails("lens", folder, PROMPT, "--jacobian", "no.pt", code=2)
    _artifact(folder, tmp_path / "j.pt")
    said = cli.fails("lens", folder, PROMPT, "--jacobian", "j.pt", "--site", "attn_out", code=2)
    assert "--jacobian reads the residual stream only" in said
    said = cli.fails("lens", folder, PROMPT, "--jacobian", "j.pt", "--tuned", ".", code=2)
    assert "--tuned and --jacobian do not combine" in said


@pytest.mark.slow
def test_text_through_a_jacobian_lens_over_two_processes(tiny, cli, tmp_path):
    from tests.test_dist import relative, torchrun
    from tests.test_tune import words_file

    folder = tiny("llama-tied")
    _artifact(folder, tmp_path / "j.pt")
    text = words_file(tmp_path / "w.txt", docs=12)
    args = ["lens", folder, "--text", text, "--ctx", "16", "--jacobian", tmp_path / "j.pt"]
    one = cli.json(*args)
    two = torchrun(*args, "--json")
    assert two.returncode == 0, two.stderr
    split = json.loads(two.stdout)
    assert split["lens"] == one["lens"] == "jacobian" and split["n_scored"] == one["n_scored"]
    for key in ("layers", "logit_layers"):
        for a, b in zip(one[key], split[key], strict=True):
            for name, value in a.items():
                if isinstance(value, float):
                    assert relative(value, b[name]) <= 1e-6, (key, name, a, b)
                else:
                    assert value == b[name], (key, name)
