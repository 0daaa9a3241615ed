"""Titles name the model, never the folder a loaded model's GGUF file sat in."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from embedlens.text import LOADED, model_title


def test_titles_name_what_was_given(tmp_path: Path):
    (tmp_path / "hf-model").mkdir()
    (tmp_path / "hf-model" / "config.json").write_text("{}")
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "m.Q8_0.gguf").write_bytes(b"GGUF")
    (tmp_path / "many").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "many" / name).write_bytes(b"GGUF")
    (tmp_path / "empty").mkdir()
    assert model_title("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert model_title("org/M-GGUF:m.Q8_0.gguf") == "org/M-GGUF:m.Q8_0.gguf"
    assert model_title("LlamaForCausalLM") == "LlamaForCausalLM"  # a class name
    assert model_title(str(tmp_path / "hf-model")) == "hf-model"
    assert model_title(str(tmp_path / "one" / "m.Q8_0.gguf")) == "m.Q8_0.gguf"
    assert model_title(str(tmp_path / "one")) == "m.Q8_0.gguf"  # the file it reads
    assert model_title(str(tmp_path / "many")) == LOADED
    assert model_title(str(tmp_path / "empty")) == LOADED
    assert model_title("") == LOADED


def _shown(report) -> str:
    from rich.console import Console

    buffer = io.StringIO()
    Console(file=buffer, width=200, color_system=None, highlight=False).print(report)
    return buffer.getvalue()


@pytest.fixture
def from_gguf_folder(tiny, tmp_path):
    """A tiny model as transformers leaves one loaded from a GGUF file among others: its
    name_or_path is the folder the file sat in."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny("llama-tied")
    model = AutoModelForCausalLM.from_pretrained(folder)
    fixtures = tmp_path / "fixtures"
    fixtures.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (fixtures / name).write_bytes(b"GGUF")
    model.name_or_path = str(fixtures)
    return model, AutoTokenizer.from_pretrained(folder)


def test_params_and_tied_of_a_loaded_model_are_not_titled_by_its_folder(from_gguf_folder):
    import embedlens

    model, _ = from_gguf_folder
    for report, title in (
        (embedlens.params(model), "Parameters of a loaded model (source: weights)"),
        (embedlens.tied(model), "Is the LM head of a loaded model the embedding?"),
    ):
        text = _shown(report)
        assert title in text and "fixtures" not in text
        assert report.model == model.name_or_path  # the JSON keeps what transformers says


def test_a_lens_of_a_loaded_model_is_not_titled_by_its_folder(from_gguf_folder):
    import embedlens

    model, tokenizer = from_gguf_folder
    text = _shown(embedlens.lens(model, "the king", tokenizer=tokenizer))
    assert "Logit lens of a loaded model after 'king'" in text and "fixtures" not in text
