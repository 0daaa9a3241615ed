"""The engine decodes every row through the decoder it is given, and checks the last layer's
decoding against the model's own logits whatever the decoder is."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from tests.models import TOKENIZER_LEN, VOCAB


def _setup(tiny: Any) -> tuple[Any, list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny("gemma2")  # a final softcap: the model's own decoder is more than a matmul
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(folder)("the king of France is")["input_ids"]
    return model, ids


class Recording:
    """The model's own decoder, noting the layers asked for; rows of `blank` decode to zeros,
    and `shift` is added to every logit of the last layer."""

    def __init__(self, model: Any, ids: list[int], blank: int | None, shift: float) -> None:
        from embedlens.analysis.lens.blocks import ModelDecoder, find_blocks

        self.own = ModelDecoder(model, find_blocks(model), ids[0])
        self.n_layers = len(find_blocks(model).modules)
        self.asked: list[int] = []
        self.blank, self.shift = blank, shift
        self.full = False

    def logits(self, rows: torch.Tensor, layers: Sequence[int]) -> torch.Tensor:
        self.asked += list(layers)
        out = self.own.logits(rows, layers)
        at = torch.tensor(layers)
        out[at == self.blank] = 0.0
        out[at == self.n_layers] += self.shift
        return out

    def watch(self, cap: Any) -> list[Any]:
        return self.own.watch(cap)

    def steps(self, row: torch.Tensor, tol: float) -> list[str]:
        return self.own.steps(row, tol)

    def suspect(self, real: Any, tol: float) -> str:
        return "the decoder given"


def test_every_row_goes_through_the_decoder_given(tiny):
    from embedlens.analysis.lens.engine import run_lens

    model, ids = _setup(tiny)
    own = run_lens(model, ids, layers=[0, 1, 2, 3], positions=[4], k=3, real_vocab=TOKENIZER_LEN)
    decoder = Recording(model, ids, blank=1, shift=0.0)
    got = run_lens(
        model, ids, layers=[0, 1, 2, 3], positions=[4], k=3, real_vocab=TOKENIZER_LEN,
        decoder=decoder,
    )  # fmt: skip
    assert sorted(set(decoder.asked)) == [0, 1, 2, 3] and len(decoder.asked) == 4
    assert got.check.ok and got.rows[(0, 4)] == own.rows[(0, 4)]
    assert got.rows[(3, 4)] == own.rows[(3, 4)]  # the last layer is the model's own output
    blank = got.rows[(1, 4)]  # zero logits: the uniform distribution, ids in order
    assert blank.ids == [0, 1, 2] and blank.probs == pytest.approx([1 / VOCAB] * 3)
    assert own.rows[(1, 4)].ids != [0, 1, 2]


def test_the_self_check_holds_any_decoder_to_the_models_logits(tiny):
    from embedlens.analysis.lens.engine import run_lens

    model, ids = _setup(tiny)
    decoder = Recording(model, ids, blank=None, shift=0.5)
    got = run_lens(
        model, ids, layers=[0, 3], positions=[4], k=3, real_vocab=TOKENIZER_LEN, decoder=decoder
    )
    assert not got.check.ok and got.check.max_abs_logit_diff == pytest.approx(0.5, abs=1e-5)
    assert got.check.suspect == "the decoder given"
