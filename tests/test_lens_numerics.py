"""`lens` on numbers that break naive code: NaN or infinity in the model (a failed run, never ✓),
and probabilities that underflow float32 (ranks and top-k follow the logits)."""

from __future__ import annotations

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
    from embedlens import loading

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
    from embedlens.analysis.lens import Check

    assert not Check(float("nan"), 1e-3, True, None).ok
    assert Check(0.0, 1e-3, True, None).ok
