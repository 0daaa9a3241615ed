"""The public decoders, `embedlens.LogitLens` and `embedlens.TunedLens`, on a caller's own
tensors: hidden states from plain transformers (`output_hidden_states=True`, and the last
block's output read by a hook, since transformers gives the final norm's output last), decoded
at each layer, give the `lens` report's figures (its top tokens among the tokenizer's, and
their probabilities under the full softmax)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

import embedlens
from tests.test_tune import words_file

PROMPT = "the king of France is"


def _hidden(model: Any, ids: torch.Tensor) -> list[torch.Tensor]:
    """Layer i's residual at every position, [1, P, d], from transformers' own outputs: the
    embedding output and each block's output but the last from `hidden_states`, the last
    block's output (before the final norm) by a hook on it."""
    from embedlens.analysis.lens.blocks import find_blocks

    last: list[torch.Tensor] = []
    block = find_blocks(model).modules[-1]
    handle = block.register_forward_hook(
        lambda _m, _a, out: last.append(out[0] if isinstance(out, tuple) else out)
    )
    try:
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
    finally:
        handle.remove()
    return [*out.hidden_states[:-1], last[0]]


def _same_figures(report: dict[str, Any], decoder: Any, hidden: list[torch.Tensor], real: int):
    """Each of the report's rows: the decoder's top-k over the first `real` ids (the tokens
    the tokenizer has) and their probabilities, from the last position's residual."""
    for row in report["layers"]:
        layer = row["layer"]
        logits = decoder(hidden[layer], layer)[0, -1]
        assert logits.dtype == torch.float32
        probs = torch.softmax(logits.double(), -1)
        k = len(row["top"])
        top = torch.topk(logits[:real], k).indices.tolist()
        assert [t["id"] for t in row["top"]] == top, layer
        for t in row["top"]:
            assert t["prob"] == pytest.approx(float(probs[t["id"]]), rel=1e-4, abs=1e-7)


def _loaded(folder: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("family", ["llama-tied", "gpt2", "gemma2"])
def test_logit_lens_on_transformers_hidden_states_gives_the_reports_figures(tiny, family):
    model, tok = _loaded(tiny(family))
    ids = tok(PROMPT, return_tensors="pt").input_ids
    report = embedlens.lens(model, PROMPT, tokenizer=tok).to_dict()
    assert [t["id"] for t in report["tokens"]] == ids[0].tolist()
    decoder = embedlens.LogitLens.from_model(model)
    hidden = _hidden(model, ids)
    _same_figures(report, decoder, hidden, len(tok))
    # the last layer decodes as the model does: its own logits
    with torch.no_grad():
        own = model(ids).logits[0, -1]
    assert float((decoder(hidden[-1], len(hidden) - 1)[0, -1] - own).abs().max()) < 1e-4
    # any leading shape: one vector, a batch of positions
    one = decoder(hidden[1][0, -1], 1)
    assert one.shape == (own.shape[0],)
    assert torch.allclose(one, decoder(hidden[1], 1)[0, -1], atol=1e-6)  # rows batch alike


def test_tuned_lens_from_a_folder_gives_the_reports_figures(tiny, tmp_path):
    folder = tiny("llama-untied")
    lens_dir = tmp_path / "lens"
    embedlens.tune(folder, words_file(tmp_path / "w.txt"), lens_dir, tokens=512, eval_tokens=128)
    model, tok = _loaded(folder)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    report = embedlens.lens(model, PROMPT, tokenizer=tok, tuned=lens_dir).to_dict()
    tuned = embedlens.TunedLens.from_folder(model, lens_dir, tokenizer=tok)
    hidden = _hidden(model, ids)
    _same_figures(report, tuned, hidden, len(tok))
    logit = embedlens.LogitLens.from_model(model)
    assert not torch.allclose(tuned(hidden[1], 1), logit(hidden[1], 1))  # translated
    assert torch.equal(tuned(hidden[-1], len(hidden) - 1), logit(hidden[-1], len(hidden) - 1))
    copied = copy.copy(tuned.decoder)  # a copy is built before its fields are set
    assert copied.own is tuned.decoder.own  # the model's own decoder's steps and hooks
    assert torch.equal(
        copied.logits(hidden[1][0], [1] * hidden[1].shape[1]), tuned(hidden[1], 1)[0]
    )


def test_a_tuned_lens_for_another_model_and_a_bad_layer_are_refused(tiny, tmp_path):
    lens_dir = tmp_path / "lens"
    embedlens.tune(tiny("gpt2"), words_file(tmp_path / "w.txt"), lens_dir, tokens=512,
                   eval_tokens=128, steps=1)  # fmt: skip
    model, _ = _loaded(tiny("llama-tied"))
    with pytest.raises(embedlens.UsageError, match="tuned for another model"):
        embedlens.TunedLens.from_folder(model, lens_dir)
    decoder = embedlens.LogitLens.from_model(model)
    with pytest.raises(embedlens.UsageError, match=r"not in 0\.\.3"):
        decoder(torch.zeros(model.config.hidden_size), 4)


def test_logit_lens_on_smollm2_gives_the_reports_figures(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = smollm2.parent, smollm2.name
    tok = AutoTokenizer.from_pretrained(where, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    model.eval()
    prompt = "The capital of France is"
    ids = tok(prompt, return_tensors="pt").input_ids
    report = embedlens.lens(model, prompt, tokenizer=tok).to_dict()
    assert [t["id"] for t in report["tokens"]] == ids[0].tolist()
    _same_figures(report, embedlens.LogitLens.from_model(model), _hidden(model, ids), len(tok))
