"""`lens` on numbers that break naive code: NaN or infinity in the model (a failed run, never ✓),
and probabilities that underflow float32 (ranks and top-k follow the logits)."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

PROMPT = "the king of France is"


def edited(
    tmp_path: Path, folder: Path, name: str, edit: Callable[[dict[str, torch.Tensor]], None]
) -> Path:
    """A copy of a tiny model whose stored tensors were edited in place."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / name
    shutil.copytree(folder, out)
    tensors = load_file(out / "model.safetensors")
    edit(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def poison(key: str, value: float = float("nan"), index: int = 0) -> Callable[..., None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[key].view(-1)[index] = value

    return edit


# --- NaN and infinity -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "key", "value", "where"),
    [
        ("llama-tied", "model.norm.weight", float("nan"), "the final norm"),
        ("llama-tied", "model.layers.1.mlp.down_proj.weight", float("nan"), "from layer 2 on"),
        ("llama-tied", "model.embed_tokens.weight", float("inf"), "embedding output (layer 0)"),
        ("llama-untied", "lm_head.weight", float("nan"), "the head's output is not"),
    ],
)
def test_model_that_gives_nan_fails_and_says_where(cli, tiny, tmp_path, family, key, value, where):
    """The final norm holding NaN once gave `max |Δ| = 0 ✓` (max(0, nan) keeps 0)."""
    index = 0 if "embed" not in key else 4 * 32  # the row of 'the' (id 4), the first token
    folder = edited(tmp_path, tiny(family), "poisoned", poison(key, value, index))
    err = cli.fails("lens", folder, PROMPT, "--target", "king", code=1)
    assert "error: the model itself gives NaN logits" in err  # an infinity in a norm ends as NaN
    assert where in err and "✓" not in err
    assert where in cli.fails("lens", folder, PROMPT, "--json", "--layers", "-1", code=1)


def test_lens_row_that_is_not_finite_fails(cli, tiny, monkeypatch):
    """The model's logits are finite but decoding a layer through its tail gives infinity."""
    from embedlens.model import loading

    real_load = loading.load_model

    def load(*args: Any, **kwargs: Any) -> Any:
        model = real_load(*args, **kwargs)

        def overflow(_m: Any, _args: Any, out: torch.Tensor) -> torch.Tensor:
            if out.shape[0] > 1:  # the lens's batch of rows, not the model's own pass
                out = out.clone()
                out[0, 0, 5] = float("inf")
            return out

        model.lm_head.register_forward_hook(overflow)
        return model

    monkeypatch.setattr(loading, "load_model", load)
    err = cli.fails("lens", tiny("llama-tied"), PROMPT, code=1)
    assert "decoding layer 0 at position 4" in err and "infinite logits" in err


def test_nan_difference_is_never_ok():
    from embedlens.analysis.lens.report import Check

    assert not Check(float("nan"), 1e-3, True, None).ok
    assert Check(0.0, 1e-3, True, None).ok


# --- probabilities that underflow float32 ---------------------------------------------------------


def _plain_logits(folder: Path, text: str) -> tuple[list[int], list[torch.Tensor]]:
    """Every layer's logits at the last position, the plain transformers way (llama family)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.test_lens import reference_tail

    ids = list(AutoTokenizer.from_pretrained(folder)(text)["input_ids"])
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
        states = out.hidden_states
        rows = [reference_tail(model, "llama-untied", s[0, -1]) for s in states[:-1]]
        rows.append(out.logits[0, -1])
    return ids, [r.float() for r in rows]


@pytest.fixture(scope="module")
def steep(tiny, tmp_path_factory) -> Path:
    """llama-untied with its head scaled 3000-fold (logits thousands apart: nearly every
    probability is 0 in float32) and rows 30..33 copies of row 29 (exact ties)."""
    out = tmp_path_factory.mktemp("steep")
    folder = tiny("llama-untied")

    def steepen(tensors: dict[str, torch.Tensor]) -> None:
        head = tensors["lm_head.weight"]
        head *= 3000.0
        head[30:34] = head[29]

    return edited(out, folder, "steep", steepen)


def test_rank_and_top_k_follow_logits_when_probabilities_underflow(cli, steep):
    from tests.models import TOKENIZER_LEN

    k = 8
    target = "house"  # some word; whatever its logit, its probability is 0 at most layers
    data = cli.json("lens", steep, PROMPT, "-k", k, "--target", target)
    ids, logits = _plain_logits(steep, PROMPT)
    assert [t["id"] for t in data["tokens"]] == ids
    target_id = data["target"]["id"]
    underflowed = 0
    for row in data["layers"]:
        x = logits[row["layer"]]
        real = x[:TOKENIZER_LEN].tolist()
        order = sorted(range(TOKENIZER_LEN), key=lambda i: (-real[i], i))  # by logit, then id
        assert [t["id"] for t in row["top"]] == order[:k]
        assert row["target"]["rank"] == order.index(target_id) + 1
        probs, logprobs = x.softmax(-1), x.double().log_softmax(-1)
        for t in row["top"]:
            assert t["prob"] == pytest.approx(float(probs[t["id"]]), abs=1e-6)
            assert t["logprob"] == pytest.approx(float(logprobs[t["id"]]), rel=1e-6, abs=1e-3)
        assert row["target"]["logprob"] == pytest.approx(float(logprobs[target_id]), rel=1e-6)
        underflowed += sum(t["prob"] == 0 for t in row["top"]) + (row["target"]["prob"] == 0)
    assert underflowed > 10  # the case this test is about: ties at p = 0 once decided the order


def test_equal_logits_rank_by_id(cli, steep):
    """Rows 29..33 of the head are equal: wherever they make the top-k, they come in id order."""
    data = cli.json("lens", steep, PROMPT, "-k", 60, "--target", "cat")  # id 31
    for row in data["layers"]:
        tied = [t["id"] for t in row["top"] if 29 <= t["id"] <= 33]
        assert tied == [29, 30, 31, 32, 33]
        assert row["target"]["rank"] == [t["id"] for t in row["top"]].index(31) + 1


def test_table_never_shows_a_zero_probability(cli, steep):
    result = cli("lens", steep, PROMPT, "-k", 4, "--target", "house", "--position", "all")
    assert result.exit_code == 0, result.stderr
    rows = [line.split("│")[2:] for line in result.stdout.splitlines() if "│" in line]
    shown = [n for row in rows for cell in row for n in re.findall(r"\d[\d.]*(?:e[-+]\d+)?", cell)]
    assert len(shown) > 40  # p, next, p(target), rank, grid cells
    assert not [n for n in shown if re.fullmatch(r"0(\.0+)?", n)]
    assert any(re.fullmatch(r"\d\.\de-\d{3,}", n) for n in shown)  # below even float64's range
