"""A Jacobian lens written by TransformerLens 4.3 (tests/data/jacobian/tl43_llama_tied.pt, made
by bench/make_jacobian_fixture.py with `JacobianLens.fit` and `JacobianLens.save` on the tiny
llama-tied model these tests build, seed 0): embedlens reads it as TransformerLens wrote it, its
matrices are the exact fit of the formula on the model rebuilt here, and reading a residual
through it (J, then the model's final norm and head) is a plain-torch computation and
TransformerLens' own readout, recorded in the file."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from embedlens.analysis.lens.jacobian import Transport, open_jacobian
from embedlens.errors import UsageError

FIXTURE = Path(__file__).parent / "data" / "jacobian" / "tl43_llama_tied.pt"
SHA256 = {  # the float16 bytes of each matrix as TransformerLens 4.3 saved them
    0: "b12925021887755f9e38e07b8fb59ab5606033b8b613d606d3cdda502185e295",
    1: "30a9917b36a223c9338f00d715f819e4fd46970613714dc73bf89aa1198c5351",
}


@pytest.fixture(scope="module")
def model(tiny: Callable[..., Path]) -> Any:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny("llama-tied"), dtype=torch.float32)
    m.eval()
    return m


def _raw() -> dict[str, Any]:
    payload: dict[str, Any] = torch.load(FIXTURE, map_location="cpu", weights_only=True)
    return payload


def test_read_as_written() -> None:
    lens, raw = open_jacobian(FIXTURE), _raw()
    assert (lens.d_model, lens.n_prompts) == (32, 3)
    assert (lens.source_layers, lens.layers) == ((0, 1), (1, 2))
    assert lens.made_by == "transformer-lens"
    assert lens.metadata == raw["metadata"]
    wanted = {
        "transformer_lens_version": "4.3.0",
        "transformer_lens_fit": True,
        "target_layer": 2,
        "skip_first_positions": 4,
        "max_seq_len": 24,
        "dim_batch": 8,
        "fit_dtype": "float32",
        "model_name": "llama-tied",
        "n_prompts": 3,
    }
    assert {k: lens.metadata[k] for k in wanted} == wanted
    for layer, digest in SHA256.items():
        stored = lens.matrices[layer].load()  # the stored bytes, as they are
        assert stored.dtype == torch.float16 and stored.shape == (32, 32)
        assert hashlib.sha256(stored.numpy().tobytes()).hexdigest() == digest
        assert torch.equal(lens.matrix(layer + 1), raw["J"][layer].float())
    lens.fits(32, 3)
    for width, blocks in ((64, 3), (32, 4)):
        with pytest.raises(UsageError, match="fitted on another model"):
            lens.fits(width, blocks)


def _block_outputs(
    model: Any, ids: list[int], swap: tuple[int, torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """Every block's output [seq, d] for `ids`; `swap` = (block, x) replaces that block's output
    with x first (so later blocks run on x)."""
    outs: list[torch.Tensor] = []

    def hook(i: int) -> Any:
        def run(_m: Any, _a: Any, out: Any) -> Any:
            tensor = out[0] if isinstance(out, tuple) else out
            if swap is not None and swap[0] == i:
                tensor = swap[1][None]
                out = (tensor, *out[1:]) if isinstance(out, tuple) else tensor
            outs.append(tensor[0])
            return out

        return run

    layers = model.model.layers
    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return outs


def test_matrices_are_the_exact_fit(model: Any) -> None:
    """J_l = mean over prompts of (1/|V|) sum_{t, t' in V} d h_final,t' / d h_l,t, row by row
    (one gradient of a sum of h_final's coordinate over V per row), V = 4 .. seq - 2: the file's
    matrices are it, to float16's rounding."""
    lens, meta = open_jacobian(FIXTURE), _raw()["metadata"]
    sums = {0: torch.zeros(32, 32), 1: torch.zeros(32, 32)}
    for ids in meta["token_ids"]:
        at = torch.arange(4, len(ids) - 1)
        with torch.no_grad():
            outs = _block_outputs(model, ids)
        for layer, total in sums.items():
            x = outs[layer].clone().requires_grad_(True)
            final = _block_outputs(model, ids, (layer, x))[-1]
            for i in range(32):  # row i: d (sum over t' in V of h_final,t',i) / d h_l, over V
                (grad,) = torch.autograd.grad(final[at, i].sum(), x, retain_graph=i < 31)
                total[i] += grad[at].mean(0)
    for layer, total in sums.items():
        exact = total / len(meta["token_ids"])
        stored = lens.matrix(layer + 1)  # embedlens numbers layers from the embedding
        assert torch.allclose(stored, exact, atol=2e-3, rtol=2e-3), (stored - exact).abs().max()
        assert torch.equal(stored, exact.half().float()) or _cosine(stored, exact) > 0.99999


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    x, y = a.double().flatten(), b.double().flatten()
    return float(x @ y / (x.norm() * y.norm()))


def test_reading_is_plain_torch_and_transformer_lens_readout(model: Any) -> None:
    """Block l's outputs of the first prompt through the file's J (embedlens layer l + 1), the
    final norm and the head: the logits a plain RMSNorm and the tied embedding give, and at every
    position TransformerLens' top 5 (ids, and logits to float32 rounding)."""
    lens, meta = open_jacobian(FIXTURE), _raw()["metadata"]
    ids = meta["token_ids"][0]
    transport = Transport(lens)
    norm, head = model.model.norm, model.lm_head
    eps, gain = norm.variance_epsilon, norm.weight.detach()
    embed = model.model.embed_tokens.weight.detach()
    with torch.no_grad():
        outs = _block_outputs(model, ids)
        final = model(torch.tensor([ids])).logits[0]
        for layer in (0, 1):
            h = outs[layer]
            ours = head(norm(transport.apply(h, [layer + 1] * len(ids))))
            y = h @ _raw()["J"][layer].float().T
            plain = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * gain @ embed.T
            assert torch.allclose(ours, plain, atol=1e-6, rtol=1e-5)
            _same_top5(ours, meta, layer)
        _same_top5(final, meta, 2)


def _same_top5(logits: torch.Tensor, meta: dict[str, Any], layer: int) -> None:
    top = logits.topk(5, dim=-1)
    assert top.indices.tolist() == meta["readout_top5"][str(layer)]
    recorded = torch.tensor(meta["readout_top5_logits"][str(layer)])
    assert torch.allclose(top.values, recorded, atol=1e-6, rtol=1e-5)
