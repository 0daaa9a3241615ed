"""Parity (`lens --against-states`, `--against-dtype`): two runs of the same weights compared
layer by layer, against a plain-torch computation from both runs' hidden states and logits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import embedlens
from embedlens.errors import UsageError
from tests.conftest import Runner

PROMPT = "The capital of France is a city that many people visit"


def _plain_run(folder: Path, dtype: torch.dtype, prompt: str, bf16_block: int | None = None):
    """Plain transformers: every block's output (hook), the embedding output, and the logits,
    for the prompt's ids; `bf16_block`: that block alone computed in bfloat16."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    layers = model.model.layers
    if bf16_block is not None:
        block = layers[bf16_block - 1].to(torch.bfloat16)
        block.register_forward_pre_hook(
            lambda _m, args, kwargs: (
                tuple(
                    a.to(torch.bfloat16) if torch.is_tensor(a) and a.is_floating_point() else a
                    for a in args
                ),
                {
                    k: (
                        v.to(torch.bfloat16)
                        if torch.is_tensor(v) and v.is_floating_point()
                        else tuple(x.to(torch.bfloat16) for x in v)
                        if k == "position_embeddings"
                        else v
                    )
                    for k, v in kwargs.items()
                },
            ),
            with_kwargs=True,
        )
        block.register_forward_hook(
            lambda _m, _a, out: (
                (out[0].float(), *out[1:]) if isinstance(out, tuple) else out.float()
            )
        )
    kept: dict[int, torch.Tensor] = {}
    hooks = [
        model.model.embed_tokens.register_forward_hook(
            lambda _m, _a, out: kept.__setitem__(0, out[0].detach().clone())
        )
    ]
    for i, layer in enumerate(layers, 1):

        def keep(_m, _a, out, i=i):
            t = out[0] if isinstance(out, tuple) else out
            kept[i] = t[0].detach().clone()

        hooks.append(layer.register_forward_hook(keep))
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    for h in hooks:
        h.remove()
    return ids[0].tolist(), kept, logits, model


def _reference(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor]) -> dict[int, tuple]:
    out = {}
    for layer in a:
        x, y = a[layer].double().numpy(), b[layer].double().numpy()
        rel = np.linalg.norm(x - y, axis=-1) / np.linalg.norm(y, axis=-1)
        cos = (x * y).sum(-1) / (np.linalg.norm(x, axis=-1) * np.linalg.norm(y, axis=-1))
        out[layer] = (rel.mean(), np.median(rel), rel.max(), cos.mean(), cos.min())
    return out


def _deltas(ids: list[int], la: torch.Tensor, lb: torch.Tensor) -> np.ndarray:
    pa = torch.log_softmax(la.double(), -1)
    pb = torch.log_softmax(lb.double(), -1)
    nxt = torch.tensor(ids[1:])
    return (pa[:-1].gather(-1, nxt[:, None]) - pb[:-1].gather(-1, nxt[:, None]))[:, 0].numpy()


def _close_to_reference(report: Any, ref: dict[int, tuple], delta: np.ndarray, tol: float) -> None:
    for row in report.layers:
        mean, median, top, cmean, cmin = ref[row.layer]
        got = (
            row.rms_rel_mean,
            row.rms_rel_median,
            row.rms_rel_max,
            row.cosine_mean,
            row.cosine_min,
        )
        assert np.allclose(got, (mean, median, top, cmean, cmin), rtol=0, atol=tol), row.layer
    o = report.output
    assert o.n_tokens == delta.size
    assert abs(o.delta_mean - delta.mean()) <= tol
    assert abs(o.delta_rms - np.sqrt((delta**2).mean())) <= tol
    assert abs(o.delta_max - np.abs(delta).max()) <= tol
    assert abs(o.delta_p99 - np.percentile(np.abs(delta), 99)) <= tol
    # a sum of n tokens' δ, each within tol
    assert abs(o.sequences[0].log_ratio - delta.sum()) <= tol * o.n_tokens


def test_a_model_against_itself_is_exactly_zero(tiny):
    folder = tiny("llama-tied")
    r = embedlens.lens_parity(folder, PROMPT, against_dtype="float32")
    assert r.first_divergent_layer is None
    for row in r.layers:
        assert (row.rms_rel_mean, row.rms_rel_max, row.kl, row.residual_kl) == (0, 0, 0, 0)
        assert (row.cosine_mean, row.cosine_min, row.top1_agree) == (1, 1, 1)
    o = r.output
    assert (o.delta_mean, o.delta_rms, o.delta_max, o.top1_flip) == (0, 0, 0, 0)
    assert o.sequences[0].ratio == 1 and o.n_over_cap == 0
    assert r.a.ok and r.b.ok


def test_two_saved_runs_of_the_same_model_are_exactly_zero(tiny, tmp_path):
    folder = tiny("llama-tied")
    for name in "ab":
        embedlens.lens(folder, PROMPT, save_states=tmp_path / f"{name}.safetensors")
    r = embedlens.lens_parity(
        folder, states=tmp_path / "a.safetensors", against_states=tmp_path / "b.safetensors"
    )
    assert all(row.rms_rel_max == 0 and row.kl == 0 for row in r.layers)
    assert r.output.delta_max == 0 and r.a.source == r.b.source == "states"
    assert r.a.ok and r.b.ok  # each file's own logits reproduced by the tail


def test_bfloat16_against_float32_equals_a_plain_torch_computation(tiny):
    folder = tiny("llama-tied")
    r = embedlens.lens_parity(folder, PROMPT, dtype="bfloat16", against_dtype="float32")
    ids, a, la, _ = _plain_run(folder, torch.bfloat16, PROMPT)
    ids_b, b, lb, _ = _plain_run(folder, torch.float32, PROMPT)
    assert ids == ids_b
    _close_to_reference(r, _reference(a, b), _deltas(ids, la, lb), 1e-6)
    assert r.layers[-1].rms_rel_mean > 1e-3  # bf16 rounding is there to measure


@pytest.mark.slow
def test_smollm2_bfloat16_against_float32_equals_plain_torch(smollm2, tmp_path):
    """The README's real model: the figures equal those from plain transformers' runs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    r = embedlens.lens_parity(
        smollm2, PROMPT, dtype="bfloat16", against_dtype="float32", layers="0,30"
    )
    runs = {}
    for dtype in (torch.bfloat16, torch.float32):
        tok = AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
        model = AutoModelForCausalLM.from_pretrained(
            smollm2.parent, gguf_file=smollm2.name, dtype=dtype
        ).eval()
        ids = tok(PROMPT, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
        hidden = list(out.hidden_states)
        kept = _last_block_output(model, ids)
        states = {i: h[0] for i, h in enumerate(hidden[:-1])} | kept  # the last is after the norm
        runs[dtype] = (ids[0].tolist(), states, out.logits[0].float())
    (ids, a, la), (_, b, lb) = runs[torch.bfloat16], runs[torch.float32]
    _close_to_reference(r, _reference(a, b), _deltas(ids, la, lb), 1e-6)
    assert r.first_divergent_layer == 0  # the embedding rounded to bfloat16 already


def _last_block_output(model: Any, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """The last block's output (before the final norm, which transformers' last hidden state
    has been through), by a hook on one more forward pass."""
    kept: dict[int, torch.Tensor] = {}
    n = len(model.model.layers)

    def keep(_m: Any, _a: Any, out: Any) -> None:
        kept[n] = (out[0] if isinstance(out, tuple) else out)[0].clone()

    hook = model.model.layers[-1].register_forward_hook(keep)
    with torch.no_grad():
        model(ids)
    hook.remove()
    return kept


def test_a_planted_bfloat16_block_is_the_first_divergent_layer(tiny, tmp_path):
    """B: one block in bfloat16, the rest float32, saved as a plain states file; A float32."""
    from safetensors.torch import save_file

    folder = tiny("llama-tied")
    ids, a, _, model = _plain_run(folder, torch.float32, PROMPT)
    n = len(model.model.layers)
    ids_b, b, _, _ = _plain_run(folder, torch.float32, PROMPT, bf16_block=2)
    assert ids == ids_b
    for name, run in (("a", a), ("b", b)):
        hidden = torch.stack([run[i] for i in range(n + 1)], dim=1)
        save_file(
            {"token_ids": torch.tensor(ids), "hidden_states": hidden.contiguous()},
            str(tmp_path / f"{name}.safetensors"),
        )
    states = {"state_layers": f"0:{n + 1}"}
    r = embedlens.lens_parity(
        folder,
        states=tmp_path / "a.safetensors",
        against_states=tmp_path / "b.safetensors",
        threshold=0,
        **states,
    )
    assert r.first_divergent_layer == 2
    assert [row.rms_rel_max for row in r.layers[:2]] == [0, 0]
    assert r.a.ok is None  # a plain file holds no logits to check against


def test_model_run_against_a_saved_file_reads_the_files_ids(tiny, tmp_path):
    folder = tiny("llama-tied")
    embedlens.lens(folder, PROMPT, dtype="bfloat16", save_states=tmp_path / "b.safetensors")
    r = embedlens.lens_parity(folder, against_states=tmp_path / "b.safetensors")
    assert r.a.source == "model" and r.b.source == "states" and r.b.dtype == "bfloat16"
    assert r.layers[-1].rms_rel_mean > 0


def test_prompts_and_text_are_many_sequences(tiny, tmp_path):
    from tests.test_tune import words_file

    folder = tiny("llama-tied")
    r = embedlens.lens_parity(
        folder,
        prompts=["Hello world", {"prompt": "the king", "id": "k"}],
        dtype="bfloat16",
        against_dtype="float32",
    )
    assert [s.name for s in r.output.sequences] == ["line 1", "k"]
    text = words_file(tmp_path / "words.txt")
    t = embedlens.lens_parity(folder, text=text, dtype="bfloat16", against_dtype="float32")
    assert t.n_sequences > 1 and t.output.sequences[0].name == "window 1"


def _save_pair(cli: Runner, folder: Path, where: Path, prompts: list[str]) -> None:
    for side, dtype in (("a", "bfloat16"), ("b", "float32")):
        (where / side).mkdir(parents=True)
        for i, p in enumerate(prompts, 1):
            res = cli(
                "lens",
                folder,
                p,
                "--dtype",
                dtype,
                "--save-states",
                where / side / f"{i:06d}.safetensors",
            )
            assert res.exit_code == 0, res.stderr


def test_the_command_compares_two_folders_and_writes_json_and_a_plot(tiny, tmp_path):
    cli = Runner()
    folder = tiny("llama-tied")
    _save_pair(cli, folder, tmp_path, ["Hello world", "the king of France"])
    res = cli(
        "lens", folder, "--states", tmp_path / "a", "--against-states", tmp_path / "b", "--json"
    )
    assert res.exit_code == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["n_sequences"] == 2 and data["a"]["dtype"] == "bfloat16"
    res = cli("lens", folder, "--states", tmp_path / "a", "--against-states", tmp_path / "b")
    assert res.exit_code == 0, res.stderr
    assert "Parity of A" in res.stdout and "importance ratio" in res.stdout
    pytest.importorskip("matplotlib")
    plot = tmp_path / "p.svg"
    res = cli(
        "lens", folder, PROMPT, "--dtype", "bfloat16", "--against-dtype", "float32", "--plot", plot
    )
    assert res.exit_code == 0, res.stderr
    assert plot.read_text().lstrip().startswith("<?xml")


@pytest.mark.parametrize(
    ("make", "said"),
    [
        ("ids", "different token ids from position"),
        ("width", "widths"),
        ("layers", "layers"),
        ("prompts", "do not hold the same prompts"),
    ],
)
def test_mismatched_sides_are_refused_with_one_line(tiny, tmp_path, make, said):
    from safetensors.torch import save_file

    folder = tiny("llama-tied")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    embedlens.lens(folder, PROMPT, save_states=tmp_path / "a" / "x.safetensors")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "a" / "x.safetensors"), "pt") as f:
        ids, hidden = f.get_tensor("token_ids"), f.get_tensor("hidden_states")
    # both sides plain files (their layers from --state-layers), A's as saved
    save_file({"token_ids": ids, "hidden_states": hidden}, str(tmp_path / "a" / "x.safetensors"))
    meta = {"state_layers": f"0:{hidden.shape[1]}"}
    name = "x.safetensors"
    if make == "ids":
        ids = ids.clone()
        ids[3] = (ids[3] + 1) % 50
    elif make == "width":
        hidden = hidden[..., :-2]
    elif make == "layers":
        hidden = hidden[:, :-1]
        meta = {"state_layers": f"0:{hidden.shape[1]}"}
    else:
        name = "y.safetensors"
    save_file({"token_ids": ids, "hidden_states": hidden.contiguous()}, str(tmp_path / "b" / name))
    a = tmp_path / "a" if make == "prompts" else tmp_path / "a" / "x.safetensors"
    res = Runner()(
        "lens",
        folder,
        "--states",
        a,
        "--against-states",
        tmp_path / "b" / name if make != "prompts" else tmp_path / "b",
        "--state-layers",
        meta["state_layers"],
    )
    assert res.exit_code == 2, res.stderr
    lines = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and said in lines[0], res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--head-dtype", "float32"], "apply to a parity run"),
        (["--against-dtype", "float32", "--tuned", "x"], "--tuned does not apply"),
        (["--against-dtype", "float32", "--position", "2"], "--position and -k"),
        (["--against-dtype", "float32", "--cap", "0.5"], "--cap 0.5"),
        (["--against-dtype", "float64"], "float64"),
    ],
)
def test_options_that_do_not_apply_are_refused(tiny, args, said):
    res = Runner()("lens", tiny("llama-tied"), PROMPT, *args)
    assert res.exit_code == 2, res.stderr
    assert said in res.stderr and "Traceback" not in res.stderr


def test_the_library_refuses_what_a_parity_run_does_not_take(tiny):
    folder = tiny("llama-tied")
    with pytest.raises(UsageError, match="jacobian does not apply"):
        embedlens.lens_parity(folder, PROMPT, against_dtype="float32", jacobian="x.pt")
    with pytest.raises(UsageError, match="either --against-states"):
        embedlens.lens_parity(folder, PROMPT, against_states="x", against_dtype="float32")


@pytest.mark.slow
def test_over_two_processes_it_prints_what_one_prints(tiny, tmp_path):
    """torchrun: window i on rank i mod 2, every rank's figures gathered in order on rank 0,
    which prints the same JSON, byte for byte, as one process."""
    from tests.test_dist import torchrun
    from tests.test_tune import words_file

    folder = tiny("llama-tied")
    text = words_file(tmp_path / "words.txt")
    args = [
        "lens",
        folder,
        "--text",
        text,
        "--ctx",
        "32",
        "--max-tokens",
        "200",
        "--dtype",
        "bfloat16",
        "--against-dtype",
        "float32",
        "--json",
    ]
    one = Runner()(*args)
    assert one.exit_code == 0, one.stderr
    two = torchrun(*args)
    assert two.returncode == 0, two.stderr
    assert json.loads(one.stdout)["n_sequences"] == 6
    assert two.stdout == one.stdout


def test_the_plain_layout_is_read_from_torch_save_and_safetensors(tiny, tmp_path):
    """A trainer's states: torch.save's dict, or safetensors, each with its `layers`; the same
    states give exactly 0."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = tiny("llama-tied")
    embedlens.lens(folder, PROMPT, save_states=tmp_path / "own.safetensors")
    with safe_open(str(tmp_path / "own.safetensors"), "pt") as f:
        ids, hidden = f.get_tensor("token_ids"), f.get_tensor("hidden_states")
    layers = torch.arange(hidden.shape[1])
    torch.save({"token_ids": ids, "hidden_states": hidden, "layers": layers}, tmp_path / "a.pt")
    save_file(
        {"token_ids": ids, "hidden_states": hidden, "layers": layers},
        str(tmp_path / "b.safetensors"),
    )
    r = embedlens.lens_parity(
        folder, states=tmp_path / "a.pt", against_states=tmp_path / "b.safetensors"
    )
    assert r.first_divergent_layer is None and r.output.delta_max == 0
    assert len(r.layers) == hidden.shape[1] and r.a.ok is None
    r = embedlens.lens_parity(folder, against_states=tmp_path / "a.pt")  # the model against it
    assert r.layers[-1].rms_rel_max == 0 and r.a.ok


class Planted:
    """What a pickle may ask to build besides tensors: refused, never built."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("ran",))


def test_a_torch_file_that_asks_for_more_than_tensors_is_refused(tiny, tmp_path):
    bad = tmp_path / "bad.pt"
    torch.save({"token_ids": torch.arange(3), "hidden_states": Planted()}, bad)
    res = Runner()("lens", tiny("llama-tied"), "--against-states", bad)
    assert res.exit_code != 0 and "Traceback" not in res.stderr
    assert "nothing in it ran" in res.stderr, res.stderr
    assert "ran" not in res.stdout


def _pieces(folder: Path, dtype: torch.dtype) -> dict[tuple[str, int], torch.Tensor]:
    """Plain transformers: each block's attention and MLP outputs (what each adds)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    kept: dict[tuple[str, int], torch.Tensor] = {}

    def keeper(key: tuple[str, int]) -> Any:
        def keep(_m: Any, _a: Any, out: Any) -> None:
            kept[key] = (out[0] if isinstance(out, tuple) else out)[0].detach().clone()

        return keep

    hooks = []
    for i, layer in enumerate(model.model.layers, 1):
        hooks.append(layer.self_attn.register_forward_hook(keeper(("attn_out", i))))
        hooks.append(layer.mlp.register_forward_hook(keeper(("mlp_out", i))))
    with torch.no_grad():
        model(tok(PROMPT, return_tensors="pt")["input_ids"])
    for h in hooks:
        h.remove()
    return kept


def test_sites_inside_the_blocks_equal_a_plain_torch_computation(tiny, tmp_path):
    folder = tiny("llama-tied")
    r = embedlens.lens_parity(
        folder, PROMPT, dtype="bfloat16", against_dtype="float32", site="attn_out,mlp_out"
    )
    a, b = _pieces(folder, torch.bfloat16), _pieces(folder, torch.float32)
    n = len(r.layers) - 1
    assert [(row.layer, row.site) for row in r.sites] == [
        (i, s) for i in range(1, n + 1) for s in ("attn_out", "mlp_out")
    ]
    for row in r.sites:
        x, y = a[row.site, row.layer].double().numpy(), b[row.site, row.layer].double().numpy()
        rel = np.linalg.norm(x - y, axis=-1) / np.linalg.norm(y, axis=-1)
        assert (
            abs(row.rms_rel_mean - rel.mean()) <= 1e-6 and abs(row.rms_rel_max - rel.max()) <= 1e-6
        )
    same = embedlens.lens_parity(folder, PROMPT, against_dtype="float32", site="mlp_out")
    assert all(row.rms_rel_max == 0 and row.cosine_min == 1 for row in same.sites)
    embedlens.lens(folder, PROMPT, save_states=tmp_path / "plain.safetensors")
    with pytest.raises(UsageError, match="does not hold --site mlp_out"):
        embedlens.lens_parity(folder, against_states=tmp_path / "plain.safetensors", site="mlp_out")


def test_the_figures_do_not_depend_on_the_thread_count():
    """Each row's figure on one thread from its row alone: 1 thread or 2, the same bits."""
    from embedlens.analysis.lens.parity_math import distances, kl_lse

    g = torch.Generator().manual_seed(0)
    za = torch.randn(300, 5000, generator=g) * 4
    zb = za + 0.01 * torch.randn(300, 5000, generator=g)
    before = torch.get_num_threads()
    got = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            kl, la, _ = kl_lse(za, zb)
            got.append((kl.tobytes(), la.numpy().tobytes(), distances(za, zb)[0].tobytes()))
            assert torch.get_num_threads() == n  # the caller's setting kept
    finally:
        torch.set_num_threads(before)
    assert got[0] == got[1]
    p, q = torch.log_softmax(za.double(), -1), torch.log_softmax(zb.double(), -1)
    plain = (p.exp() * (p - q)).sum(-1).numpy()
    assert np.abs(kl - plain).max() <= 1e-13  # float64 rounding of either formula
    assert kl_lse(za, za)[0].max() == 0


def test_b_states_past_the_memory_kept_wait_on_disk_and_give_the_same(tiny, monkeypatch):
    from embedlens.analysis.lens import parity_sources

    folder = tiny("llama-tied")
    prompts = ["Hello world", "the king of France", "a cat"]
    kept = embedlens.lens_parity(
        folder, prompts=prompts, dtype="bfloat16", against_dtype="float32", site="mlp_out"
    )
    monkeypatch.setattr(parity_sources, "KEPT_BYTES", 0)  # every sequence's B written out
    spilled = embedlens.lens_parity(
        folder, prompts=prompts, dtype="bfloat16", against_dtype="float32", site="mlp_out"
    )
    assert spilled.to_json() == kept.to_json()
