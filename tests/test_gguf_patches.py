"""The GGUF read-sharing patches: applied only to what transformers and gguf still have."""

from __future__ import annotations

from pathlib import Path

import pytest

from embedlens.compat.transformers import gguf_patches


def test_the_installed_transformers_and_gguf_can_be_patched():
    """Fails when transformers or gguf move or re-sign what the patches replace: update
    gguf_patches.EXPECTED then (loading still works unpatched, only slower)."""
    assert gguf_patches.patchable()


def test_a_gguf_load_parses_the_file_once(smollm2: Path):
    """The config and the tokenizer share one reader inside the context (the weights too: the
    lens tests load SmolLM2 that way)."""
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    made: list[object] = []
    original = gguf.GGUFReader

    class Counting(original):  # type: ignore[misc,valid-type]
        def __init__(self, path: object, mode: str = "r") -> None:
            made.append(self)
            super().__init__(path, mode)

    where, name = str(smollm2.parent), smollm2.name
    gguf.GGUFReader = Counting
    try:
        with gguf_patches.sharing_gguf_reads():
            AutoConfig.from_pretrained(where, gguf_file=name)
            AutoTokenizer.from_pretrained(where, gguf_file=name)
        assert gguf.GGUFReader is Counting  # undone on the way out
    finally:
        gguf.GGUFReader = original
    assert len(made) == 1


def test_a_changed_signature_turns_the_patches_off(monkeypatch: pytest.MonkeyPatch):
    import gguf

    def moved(tensor_data, quant_type):  # type: ignore[no-untyped-def]
        return None

    monkeypatch.setattr(gguf, "dequantize", moved)
    assert not gguf_patches.patchable()
    with gguf_patches.sharing_gguf_reads():
        assert gguf.dequantize is moved and gguf.GGUFReader.__name__ == "GGUFReader"


def test_the_weights_load_skips_the_tokenizer_fields_and_loads_the_same_weights(smollm2: Path):
    """Inside the context the weights' load parses no tokenizer field (some 147k values for
    SmolLM2) and gives exactly the tensors transformers loads unpatched."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import ggml

    where, name = str(smollm2.parent), smollm2.name
    plain = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    parsed: list[int] = []
    original = ggml._gguf_parse_value

    def counting(value, data_type):  # type: ignore[no-untyped-def]
        parsed.append(1)
        return original(value, data_type)

    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    before = hf_gguf._gguf_parse_value
    hf_gguf._gguf_parse_value = counting
    try:
        with gguf_patches.sharing_gguf_reads():
            AutoConfig.from_pretrained(where, gguf_file=name)  # the metadata parse, kept
            parsed.clear()
            shared = AutoModelForCausalLM.from_pretrained(
                where, gguf_file=name, dtype=torch.float32
            )
    finally:
        hf_gguf._gguf_parse_value = before
    assert 0 < len(parsed) < 1000  # the architecture's fields, not 49k tokens and merges
    a, b = plain.state_dict(), shared.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
