"""The Jacobian lens's fit: the exact estimator against the formula computed by plain torch, the
sketch's convergence and seed, `tune --jacobian` end to end, and its refusals."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from tests.test_api_lens import _same_state, _state
from tests.test_tune import _load, words_file

SMALL = ["--tokens", "512", "--eval-tokens", "128", "--method", "affine", "--seq-len", "32"]


def _rows(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def formula(
    model: Any, ids: Sequence[int], layers: list[int], skip: int, dims: Sequence[int] | None = None
) -> dict[int, torch.Tensor]:
    """J_l of one prompt from the definition: a zero `delta` added to block l's output, the last
    block's output differentiated with respect to it (batch 1). dims None: the whole Jacobian by
    torch.autograd.functional.jacobian, summed over valid target and source positions; else the
    rows `dims` alone, one autograd.grad per output dimension."""
    blocks = model.model.layers if hasattr(model, "model") else model.transformer.h
    last = blocks[len(blocks) - 1]
    seq, d = len(ids), model.config.hidden_size
    valid = list(range(skip, seq - 1))

    def run(*deltas: torch.Tensor) -> torch.Tensor:
        got: dict[str, torch.Tensor] = {}

        def add(k: int) -> Any:
            def hook(_m: Any, _a: Any, out: Any) -> Any:
                moved = _rows(out) + deltas[k][None]
                return (moved, *out[1:]) if isinstance(out, tuple) else moved

            return hook

        def keep(_m: Any, _a: Any, out: Any) -> None:
            got["y"] = _rows(out)[0]

        handles = [blocks[layer].register_forward_hook(add(k)) for k, layer in enumerate(layers)]
        handles.append(last.register_forward_hook(keep))
        try:
            model(torch.tensor([list(ids)]), use_cache=False)
        finally:
            for h in handles:
                h.remove()
        return got["y"]

    zeros = tuple(torch.zeros(seq, d) for _ in layers)
    if dims is None:
        full = torch.autograd.functional.jacobian(run, zeros)  # [seq, d, seq, d] per layer
        return {
            layer: sum(full[k][tp, :, t, :] for t in valid for tp in valid) / len(valid)
            for k, layer in enumerate(layers)
        }
    deltas = tuple(z.clone().requires_grad_(True) for z in zeros)
    y = run(*deltas)
    out = {layer: torch.zeros(len(dims), d) for layer in layers}
    for i, dim in enumerate(dims):
        pick = torch.zeros_like(y)
        pick[valid, dim] = 1.0
        grads = torch.autograd.grad(y, deltas, pick, retain_graph=True)
        for k, layer in enumerate(layers):
            out[layer][i] = grads[k][valid].mean(0)
    return out


def _mean(per_prompt: list[dict[int, torch.Tensor]]) -> dict[int, torch.Tensor]:
    return {k: sum(p[k] for p in per_prompt) / len(per_prompt) for k in per_prompt[0]}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    x, y = a.double().flatten(), b.double().flatten()
    return float(x @ y / (x.norm() * y.norm()))


PROMPTS = [[5, 9, 14, 3, 22, 7, 40, 11, 8, 30], [12, 6, 33, 21, 4, 19, 27, 8, 2, 15, 44, 9], [7, 8]]


@pytest.mark.parametrize("family", ["llama-tied", "gpt2"])
def test_the_exact_fit_is_the_formula(tiny, family):
    from embedlens.analysis.tune.jacobian import fit_jacobian

    model, _ = _load(tiny(family))
    fit = fit_jacobian(model, PROMPTS, skip_first=2, dim_batch=8)
    assert fit.n_prompts == 2 and fit.skipped == 1  # [7, 8] has no valid position at skip 2
    d = model.config.hidden_size
    assert fit.backward_passes == 2 * -(-d // 8) and fit.forward_passes == 2
    layers = sorted(fit.matrices)
    assert layers == list(range(model.config.num_hidden_layers - 1))
    want = _mean([formula(model, ids, layers, 2) for ids in PROMPTS[:2]])
    for layer in layers:
        assert fit.matrices[layer].dtype == torch.float32
        assert _relative(fit.matrices[layer], want[layer]) < 1e-4, layer
    odd = fit_jacobian(model, PROMPTS, skip_first=2, dim_batch=5, layers=[1])
    assert list(odd.matrices) == [1] and _relative(odd.matrices[1], want[1]) < 1e-4


def test_the_sketch_approaches_the_exact_fit_and_follows_its_seed(tiny):
    from embedlens.analysis.tune.jacobian import fit_jacobian

    model, _ = _load(tiny("llama-tied"))
    exact = fit_jacobian(model, PROMPTS, skip_first=2)

    def sketch(probes: int, **kw: Any) -> Any:
        kw.setdefault("probe_kind", "rademacher")  # i.i.d. probes: the noise falls with r
        return fit_jacobian(model, PROMPTS, skip_first=2, estimator="sketch", probes=probes,
                            agree=1.0, **kw)  # fmt: skip

    cos = {r: [_cosine(sketch(r).matrices[k], exact.matrices[k]) for k in exact.matrices]
           for r in (16, 64, 512)}  # fmt: skip
    for k in range(len(exact.matrices)):
        assert cos[16][k] < cos[64][k] < cos[512][k], cos
    assert min(cos[512]) > 0.99
    plain = sketch(64, control="none")
    with_control = sketch(64)
    for k in exact.matrices:  # the identity as a control variate: closer at the same cost
        assert _cosine(plain.matrices[k], exact.matrices[k]) < cos[64][k]
    assert with_control.backward_passes == plain.backward_passes == 2 * 8
    again = sketch(64)
    assert all(torch.equal(again.matrices[k], with_control.matrices[k]) for k in exact.matrices)
    other = sketch(64, seed=1)
    assert not torch.equal(other.matrices[0], with_control.matrices[0])
    gauss = sketch(512, probe_kind="gaussian")
    assert min(_cosine(gauss.matrices[k], exact.matrices[k]) for k in exact.matrices) > 0.98


def test_orthogonal_probes_give_the_exact_fit_where_every_prompt_has_one_j(tiny):
    """Each half's probes are rows of random orthogonal matrices (times sqrt d): every d of them
    sum v v^T to d I, so where every prompt has the same J (one prompt, repeated) a half with d
    probes gives it exactly, at a quarter of the exact fit's backward passes here."""
    from embedlens.analysis.tune.jacobian import fit_jacobian

    model, _ = _load(tiny("llama-tied"))
    d = model.config.hidden_size
    same = [PROMPTS[0]] * 8
    exact = fit_jacobian(model, same[:1], skip_first=2)
    # 8 prompts x 8 probes a half (2 passes of 8 a prompt) = 64 = 2d probes a half
    sketch = fit_jacobian(model, same, skip_first=2, estimator="sketch", probes=16, agree=1.0)
    assert sketch.probe_kind == "orthogonal" and sketch.backward_passes == 8 * 2
    assert exact.backward_passes == -(-d // 8) == 2 * 16 // 8  # a prompt: 4 passes, the sketch 2
    for k in exact.matrices:
        assert _relative(sketch.matrices[k], exact.matrices[k]) < 1e-4, k
    mixed = fit_jacobian(model, PROMPTS, skip_first=2, estimator="sketch", probes=16, agree=1.0)
    iid = fit_jacobian(model, PROMPTS, skip_first=2, estimator="sketch", probes=16, agree=1.0,
                       probe_kind="rademacher")  # fmt: skip
    truth = fit_jacobian(model, PROMPTS, skip_first=2)
    for k in truth.matrices:  # prompts with their own J: still closer than i.i.d. probes
        assert _cosine(mixed.matrices[k], truth.matrices[k]) > _cosine(
            iid.matrices[k], truth.matrices[k]
        )


def test_the_sketch_stops_when_its_halves_agree(tiny):
    from embedlens.analysis.tune.jacobian import fit_jacobian

    model, _ = _load(tiny("gpt2"))
    loose = fit_jacobian(model, PROMPTS, skip_first=2, estimator="sketch", probes=512, agree=0.9)
    assert loose.agreed and loose.agreement is not None
    assert min(loose.agreement.values()) >= 0.9 and loose.probes is not None
    assert loose.probes < 512 and loose.backward_passes == 2 * loose.probes // 8
    strict = fit_jacobian(model, PROMPTS, skip_first=2, estimator="sketch", probes=32, agree=1.0)
    assert strict.agreed is False and strict.probes == 32 and strict.backward_passes == 8
    assert strict.forward_passes == 2 * 3  # rounds of 1, 1 and 2 passes: a forward pass each


def test_the_callers_model_and_process_are_left_as_found(tiny):
    from embedlens.analysis.tune.jacobian import fit_jacobian

    model, _ = _load(tiny("gpt2"))
    model.train()
    model.transformer.h[0].requires_grad_(False)
    before = _state(model)
    flags = [p.requires_grad for p in model.parameters()]
    with torch.no_grad():
        fit_jacobian(model, PROMPTS, skip_first=2, estimator="sketch", probes=16)
        assert not torch.is_grad_enabled()
    assert model.training and all(m.training for m in model.modules())
    assert [p.requires_grad for p in model.parameters()] == flags
    _same_state(before, _state(model))


def test_tune_jacobian_writes_the_artifact_and_evaluates_it(tiny, cli, tmp_path):
    from embedlens.analysis.lens.jacobian import open_jacobian

    folder = tiny("llama-tied")
    data = words_file(tmp_path / "w.txt")
    plain = cli("tune", folder, "--data", data, "--out", tmp_path / "a", *SMALL, "--json")
    assert plain.exit_code == 0, plain.stderr
    out = tmp_path / "lens"
    args = ["--jacobian", "--skip-first", "4", "--jacobian-tokens", "64"]
    report = cli.json("tune", folder, "--data", data, "--out", out, *SMALL, *args)
    j = report["jacobian"]
    assert j["path"] == str(out / "jacobian_lens.pt") and j["estimator"] == "exact"
    assert j["prompts"] == 2 and j["tokens"] == 64 and j["probes"] is None
    lens = open_jacobian(out)
    assert lens.made_by == "embedlens" and lens.n_prompts == 2
    assert lens.source_layers == (0, 1) and lens.layers == (1, 2) and lens.d_model == 32
    meta = lens.metadata
    assert meta["target_layer"] == 2 and meta["model_name"] == str(folder)
    assert meta["embedlens"]["skip_first"] == 4 and meta["embedlens"]["seq_len"] == 32
    assert meta["embedlens"]["backward_passes"] == j["backward_passes"] == 2 * 4
    rows = report["layers"]
    for row in rows:
        assert {"jacobian_kl", "jacobian_ce", "jacobian_kl_bpb", "jacobian_ce_bpb"} <= set(row)
    assert rows[0]["jacobian_kl"] == pytest.approx(rows[0]["logit_kl"], rel=1e-6)  # identity
    assert rows[-1]["jacobian_kl"] == 0.0 and rows[-1]["jacobian_ce"] == rows[-1]["logit_ce"]
    assert rows[1]["jacobian_kl"] != rows[1]["logit_kl"]
    shown = cli("tune", folder, "--data", data, "--out", tmp_path / "b", *SMALL, *args)
    assert shown.exit_code == 0 and "J KL" in shown.stdout and "Jacobian lens" in shown.stdout
    again = json.loads(plain.stdout)
    assert "jacobian" not in again and all("jacobian_kl" not in r for r in again["layers"])


def test_tune_jacobian_sketch_from_python_leaves_the_model_as_found(tiny, tmp_path):
    from embedlens import tune

    model, tokenizer = _load(tiny("gpt2"))
    model.train()
    before = _state(model)
    report = tune(model, words_file(tmp_path / "w.txt"), tmp_path / "lens", tokenizer=tokenizer,
                  tokens=512, eval_tokens=128, method="affine", seq_len=32, jacobian=True,
                  estimator="sketch", probes=16, skip_first=4, jacobian_tokens=64)  # fmt: skip
    _same_state(before, _state(model))
    assert model.training
    j = report.jacobian
    assert j is not None and j.estimator == "sketch" and j.probes is not None
    assert j.agreement is not None and len(j.agreement) == 2
    assert (tmp_path / "lens" / "jacobian_lens.pt").is_file()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--estimator", "sketch"], "apply to the Jacobian lens: add --jacobian"),
        (["--skip-first", "3"], "apply to the Jacobian lens"),
        (["--jacobian", "--probes", "16"], "--probes applies to --estimator sketch"),
        (["--jacobian", "--estimator", "nope"], "unknown --estimator"),
        (["--jacobian", "--estimator", "sketch", "--probes", "7"], "--probes must be an even"),
        (["--jacobian", "--skip-first", "31"], "--skip-first 31 leaves no valid position"),
        (["--jacobian", "--jacobian-tokens", "0"], "--jacobian-tokens must be a positive"),
    ],
)
def test_bad_jacobian_options(tiny, cli, tmp_path, args, says):
    data = words_file(tmp_path / "w.txt")
    out = tmp_path / "lens"
    err = cli.fails("tune", tiny("llama-tied"), "--data", data, "--out", out, *SMALL, *args,
                    code=2)  # fmt: skip
    assert says in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.txt"]


def test_bad_fit_arguments(tiny):
    from embedlens.analysis.tune.jacobian import fit_jacobian
    from embedlens.errors import UsageError

    model, _ = _load(tiny("gpt2"))
    for kwargs, says in [
        ({"skip_first": 20}, "no sequence has a valid position"),
        ({"layers": [2]}, "blocks 0..1's outputs"),
        ({"estimator": "exact", "probes": 8}, "the exact estimator has none"),
        ({"estimator": "sketch", "dim_batch": 3}, "must be even"),
        ({"estimator": "sketch", "agree": 1.5}, "agree must be a cosine"),
    ]:
        with pytest.raises(UsageError, match=says):
            fit_jacobian(model, PROMPTS, **kwargs)


# --- SmolLM2: the exact fit is the formula -----------------------------------------------------


@pytest.mark.slow
def test_smollm2_exact_fit_is_the_formula(smollm2):
    from embedlens.analysis.tune.jacobian import fit_jacobian
    from embedlens.io.source import resolve
    from embedlens.model import loading

    model = loading.load_model(resolve(str(smollm2)), dtype="float32")
    prompts = [[1, 504, 3458, 282, 4649, 314, 7042, 30, 378, 11126, 7706, 260],
               [504, 1380, 2114, 418, 253, 1345, 28, 357, 2730, 3807, 29]]  # fmt: skip
    layers = [26, 27, 28]  # the last three with a matrix: the backward runs through 4 blocks
    fit = fit_jacobian(model, prompts, skip_first=4, dim_batch=96, layers=layers)
    dims = list(range(0, 576, 37))  # 16 rows of each matrix, from the definition
    want = _mean([formula(model, ids, layers, 4, dims) for ids in prompts])
    for layer in layers:
        assert _relative(fit.matrices[layer][dims], want[layer]) < 1e-4, layer
