"""`lens` work kept proportional to what is shown: a grid's cells reduced to their top-1 whatever
-k is, and a -k past the vocabulary clamped to it with a note."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models import TOKENIZER_LEN

PROMPT = "the king of France is"


def _load(folder: Path) -> tuple[Any, list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, list(AutoTokenizer.from_pretrained(folder)(PROMPT)["input_ids"])


def test_grid_cells_are_the_top1_of_a_full_run(tiny):
    """Only the position read keeps the top-k (all of the vocabulary here) and the target; every
    other cell holds the top-1 a full run gives, to the bit."""
    from embedlens.analysis.lens_engine import run_lens

    model, ids = _load(tiny("qwen3"))
    last = len(ids) - 1
    args = {"layers": [0, 1, 2, 3], "positions": list(range(len(ids))), "target": 20}
    full = run_lens(model, ids, k=4, real_vocab=TOKENIZER_LEN, **args)
    grid = run_lens(model, ids, k=TOKENIZER_LEN, real_vocab=TOKENIZER_LEN, full_at=[last], **args)
    assert grid.rows.keys() == full.rows.keys()
    for (layer, pos), top in full.rows.items():
        cell = grid.rows[(layer, pos)]
        if pos == last:
            assert len(cell.ids) == TOKENIZER_LEN and cell.ids[:4] == top.ids
            assert cell.probs[:4] == top.probs and cell.logprobs[:4] == top.logprobs
            assert (cell.target_prob, cell.target_rank) == (top.target_prob, top.target_rank)
        else:
            assert (cell.ids, cell.probs, cell.logprobs) == (
                top.ids[:1],
                top.probs[:1],
                top.logprobs[:1],
            )
            assert cell.target_rank is None


def test_a_decoded_row_that_is_not_finite_is_refused_and_an_overflowing_sum_is_not():
    from embedlens.analysis.lens_engine import _check_decoded
    from embedlens.errors import NumericError

    pos = torch.tensor([7, 9])
    fine = torch.full((2, 4), 3e38)  # finite logits whose sum overflows float32
    _check_decoded(fine, [(2, 0), (2, 1)], pos)
    for bad in (float("inf"), float("nan")):
        out = fine.clone()
        out[1, 2] = bad
        with pytest.raises(NumericError, match="layer 2 at position 9"):
            _check_decoded(out, [(2, 0), (2, 1)], pos)
