"""`vocab --check-fit`: the loss with a tokenizer judged against the model's own tokenizer on the
same text (or, without it, against the loss expected of a trained model), and per language what
moved; on tiny random models and on SmolLM2."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from embedlens.analysis.vocab.fit import EXPECTED, EXPECTED_RISE, FIT_MARGIN, OWN_RISE

SHIFT_FROM = 20_000  # SmolLM2's ids from here on move by 4: four tokens inserted


def _judged(x: dict, margin: float) -> bool:
    """The verdict from the figures: the shift costs the margin, the rise is within the threshold."""
    if x["loss"] is None:
        return False
    return x["shifted_loss"] - x["loss"] >= margin and x["rise"] <= x["threshold"]


def test_random_weights_fit_not_even_their_own_tokenizer(cli, tiny):
    """The model's own tokenizer is what is checked: judged against the expectation, and the
    random weights fail the shift contrast whatever the reference."""
    data = cli.json("vocab", tiny("llama-tied"), "--check-fit")
    fit = data["fit"]
    assert fit["reference"] == "expectation" and fit["margin"] == FIT_MARGIN
    for x in fit["languages"]:
        assert x["own_tokens"] == x["tokens"] and x["own_loss"] == x["loss"]
        assert x["reference_loss"] == EXPECTED[x["language"]]
        assert x["threshold"] == EXPECTED_RISE
        assert x["rise"] == pytest.approx(x["loss"] - EXPECTED[x["language"]])
        assert x["fits"] is _judged(x, fit["margin"]) is False
    assert fit["fits"] is False
    assert any(
        p.startswith("the weights do not fit this tokenizer: en: ") for p in data["problems"]
    )


def test_a_model_with_fewer_positions_than_a_text_is_refused(cli, tiny):
    """The tiny GPT-2 takes 64 positions, fewer than a built-in text's tokens: refused in one
    line (before: an IndexError from its position table)."""
    config = json.loads((tiny("gpt2") / "config.json").read_text())
    message = cli.fails("vocab", tiny("gpt2"), "--check-fit", code=1)
    assert f"this model takes {config['n_positions']} positions" in message
    assert "--check-fit scores built-in texts, one of " in message


def test_the_own_tokenizer_given_is_the_reference(cli, tiny):
    """--tokenizer naming the model's own tokenizer: the same ids, a rise of exactly 0, and still
    no fit for random weights (their ids score no better than ids shifted by one)."""
    folder = tiny("llama-tied")
    data = cli.json("vocab", folder, "--check-fit", "--tokenizer", folder / "tokenizer.json")
    fit = data["fit"]
    assert fit["reference"] == "own_tokenizer"
    for x in fit["languages"]:
        assert x["own_loss"] == x["loss"] == x["reference_loss"] and x["rise"] == 0.0
        assert x["threshold"] == OWN_RISE
        assert x["fits"] is False
    problem = next(p for p in data["problems"] if "do not fit" in p)
    assert "its ids score no better than ids shifted by one" in problem
    assert data["notes"] == []
    table = cli("vocab", folder, "--check-fit", "--tokenizer", folder / "tokenizer.json")
    assert "own tokenizer" in table.stdout and "NO" in table.stdout


def test_without_its_own_tokenizer_the_expectation_is_said(cli, tiny, tmp_path):
    """A folder without tokenizer.json: the own tokenizer cannot be read, a note says so and the
    expectation is the reference."""
    folder = tmp_path / "bare"
    shutil.copytree(tiny("llama-tied"), folder)
    given = tmp_path / "tokenizer.json"
    (folder / "tokenizer.json").rename(given)
    data = cli.json("vocab", folder, "--check-fit", "--tokenizer", given)
    fit = data["fit"]
    assert fit["reference"] == "expectation"
    for x in fit["languages"]:
        assert x["own_loss"] is None and x["own_tokens"] is None
        assert x["reference_loss"] == EXPECTED[x["language"]]
    assert any(
        n.startswith("--check-fit: its own tokenizer cannot be read") for n in data["notes"]
    ), data["notes"]


# --- SmolLM2 (real) ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_tokenizers(smollm2, tmp_path_factory) -> tuple[Path, Path]:
    """SmolLM2's own tokenizer.json, and a copy whose ids from SHIFT_FROM on moved by 4."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("smol-tokenizers")
    AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name).save_pretrained(
        folder / "own"
    )
    own = folder / "own" / "tokenizer.json"
    data = json.loads(own.read_text())
    vocab = data["model"]["vocab"]
    order = sorted(vocab, key=vocab.get)
    new = [f"<new_{k}>" for k in range(4)]
    order = order[:SHIFT_FROM] + new + order[SHIFT_FROM:-4]  # the same size as before
    data["model"]["vocab"] = {t: i for i, t in enumerate(order)}

    def parts(m: str | list[str]) -> list[str]:
        return m.split(" ") if isinstance(m, str) else m

    kept = data["model"]["vocab"]  # the 4 last tokens are gone, and the merges that build them
    data["model"]["merges"] = [
        m
        for m in data["model"]["merges"]
        if all(p in kept for p in parts(m)) and "".join(parts(m)) in kept
    ]
    shifted = folder / "shifted.json"
    shifted.write_text(json.dumps(data))
    return own, shifted


def test_smollm2_a_vocabulary_shifted_from_20000_does_not_fit(cli, smollm2, smol_tokenizers):
    """Only the rarer tokens move (10 of 330 in English): the shift contrast still passes, the
    rise over SmolLM2's own tokenizer does not."""
    _, shifted = smol_tokenizers
    data = cli.json("vocab", smollm2, "--check-fit", "--tokenizer", shifted)
    fit = data["fit"]
    assert fit["reference"] == "own_tokenizer" and fit["fits"] is False, fit
    en, zh = fit["languages"]
    for x, own, given in ((en, 3.35, 4.11), (zh, 2.78, 7.82)):
        assert x["tokens"] == x["own_tokens"]  # the same pieces, some at other ids
        assert x["own_loss"] == pytest.approx(own, abs=0.02)
        assert x["loss"] == pytest.approx(given, abs=0.02)
        assert x["reference_loss"] == x["own_loss"]
        assert x["rise"] == pytest.approx(x["loss"] - x["own_loss"], abs=1e-5)
        assert x["threshold"] == OWN_RISE < x["rise"]
        assert x["shifted_loss"] - x["loss"] >= fit["margin"]  # what the old verdict read alone
        assert x["fits"] is _judged(x, fit["margin"]) is False
    problem = next(p for p in data["problems"] if "do not fit" in p)
    assert "en: 4.11 nats per token against 3.35 with the model's own tokenizer (+0.76" in problem
    assert "zh: 7.82 nats per token against 2.78" in problem


def test_smollm2_its_own_tokenizer_fits(cli, smollm2, smol_tokenizers):
    """The unmodified tokenizer given with --tokenizer: the same ids, no rise, it fits."""
    own, _ = smol_tokenizers
    data = cli.json("vocab", smollm2, "--check-fit", "--tokenizer", own)
    fit = data["fit"]
    assert fit["reference"] == "own_tokenizer" and fit["fits"] is True, fit
    for x in fit["languages"]:
        assert x["rise"] == 0.0 and x["loss"] == x["own_loss"]
        assert math.isfinite(x["loss"]) and x["fits"] is True
    assert not any("do not fit" in p for p in data["problems"])
