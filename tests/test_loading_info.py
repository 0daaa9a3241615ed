"""A load that transformers would complete with random values is refused (issue: `lens` on
random weights): a weight the checkpoint lacks or holds in another shape is an error naming it;
a tied head or a computed buffer is not; tensors the model does not use are a note."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from embedlens.compat.transformers import fast

PROMPT = "the king of France is"


def broken(
    tmp_path: Path,
    folder: Path,
    edit: Callable[[dict[str, torch.Tensor]], None],
    config: dict[str, object] | None = None,
) -> Path:
    """A copy of a tiny model whose model.safetensors (and config) were edited."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / (folder.name + "-broken")
    shutil.copytree(folder, out)
    tensors = load_file(out / "model.safetensors")
    edit(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    if config:
        path = out / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return out


def test_untied_model_without_its_head(cli, tiny, tmp_path):
    folder = broken(tmp_path, tiny("llama-untied"), lambda t: t.pop("lm_head.weight"))
    err = cli.fails("lens", folder, PROMPT, code=1)
    assert "lacks 1 of the model's weights (lm_head.weight)" in err
    assert "random values" in err
    for command in ("params", "tied"):
        assert "lm_head.weight" in cli.fails(command, folder, "--load", code=1)


def test_one_projection_missing(cli, tiny, tmp_path):
    name = "model.layers.1.self_attn.q_proj.weight"
    folder = broken(tmp_path, tiny("llama-untied"), lambda t: t.pop(name))
    assert f"lacks 1 of the model's weights ({name})" in cli.fails("lens", folder, PROMPT, code=1)


def test_config_with_more_layers_than_stored(cli, tiny, tmp_path):
    """Caught before transformers reads a weight: the config and the stored blocks disagree."""
    folder = broken(tmp_path, tiny("llama-untied"), lambda t: None, {"num_hidden_layers": 6})
    err = cli.fails("lens", folder, PROMPT, code=1)
    assert "says layers 6, but the checkpoint stores 3" in err, err


def test_many_weights_missing_are_counted(cli, tiny, tmp_path):
    """Every block's q_proj and k_proj gone: the first few named, and how many in all."""

    def drop(tensors):
        for name in [n for n in tensors if n.endswith(("q_proj.weight", "k_proj.weight"))]:
            tensors.pop(name)

    folder = broken(tmp_path, tiny("llama-untied"), drop)
    err = cli.fails("lens", folder, PROMPT, code=1)
    assert "lacks 6 of the model's weights (model.layers.0.self_attn.k_proj.weight, " in err, err
    assert "and 3 more" in err


def test_mismatched_shape_names_tensor_and_both_shapes(cli, tiny, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"
    folder = broken(tmp_path, tiny("llama-untied"), lambda t: t.update({name: torch.zeros(60, 32)}))
    err = cli.fails("tied", folder, "--load", code=1)
    assert f"{name} is [60, 32] in the checkpoint but [64, 32] in the model" in err
    assert "above report" not in err


def test_conversion_failure_names_the_tensor(cli, tiny, tmp_path):
    """Per-expert weights merged on load: one of another shape stops transformers' conversion."""
    name = "model.layers.0.mlp.experts.1.gate_proj.weight"
    folder = broken(tmp_path, tiny("qwen3-moe"), lambda t: t.update({name: torch.zeros(15, 32)}))
    err = cli.fails("params", folder, "--load", code=1)
    assert "above report" not in err  # transformers points at a report it logs, kept quiet
    if not fast():  # the public path: transformers does not say which
        assert "transformers could not convert some of the checkpoint's weights" in err
        return
    assert "could not convert 1 of the checkpoint's weights" in err
    assert "model.layers.0.mlp.experts.gate_up_proj" in err and "[15, 32]" in err


def test_conversion_failure_on_the_public_path_points_at_no_hidden_report(
    cli, tiny, tmp_path, monkeypatch
):
    """EMBEDLENS_PLAIN=1 (or a release the shortcuts are not checked on): the failure is said
    without transformers' pointer to a report embedlens keeps quiet."""
    monkeypatch.setenv("EMBEDLENS_PLAIN", "1")
    test_conversion_failure_names_the_tensor(cli, tiny, tmp_path)


def test_unexpected_tensor_is_a_note(cli, tiny, tmp_path):
    folder = broken(tmp_path, tiny("llama-untied"), lambda t: t.update({"extra.w": torch.ones(3)}))
    result = cli("lens", folder, PROMPT, "--layers", "-1")
    assert result.exit_code == 0, result.stderr
    assert "note: the checkpoint holds 1 tensor the model does not use (extra.w)" in result.stderr
    assert "✓ self-check" in result.stdout


def test_stored_copy_of_tied_head_and_computed_buffers_pass(cli, tiny, tmp_path):
    """A tied head the checkpoint also stores, rotary inv_freq (never stored): no error, no note."""

    def add_head(t: dict[str, torch.Tensor]) -> None:
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    for folder in (tiny("llama-tied"), broken(tmp_path, tiny("llama-tied"), add_head)):
        result = cli("tied", folder, "--load")
        assert result.exit_code == 0, result.stderr
        assert "does not use" not in result.stderr and "error" not in result.stderr


def test_gguf_with_more_blocks_than_stored(cli, smollm2, tmp_path):
    """SmolLM2's block_count raised from 30 to 40: blocks 30..39 are not in the file."""
    data = bytearray(smollm2.read_bytes())
    key = b"llama.block_count"
    at = data.find(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    assert struct.unpack_from("<II", data, at) == (4, 30)  # uint32, 30 blocks
    struct.pack_into("<I", data, at + 4, 40)
    path = tmp_path / "SmolLM2-40-blocks.gguf"
    path.write_bytes(bytes(data))
    err = cli.fails("lens", path, "The capital of France is", code=1)
    assert "says layers 40, but the checkpoint stores 30" in err, err


@pytest.mark.parametrize("family", ["gpt2", "opt", "gemma2", "phi", "qwen3-moe"])
def test_complete_checkpoints_load_silently(cli, tiny, family):
    result = cli("tied", tiny(family), "--load")
    assert result.exit_code == 0, result.stderr
    assert "note:" not in result.stderr


def test_the_header_checks_run_once_per_source_and_trust(tiny, monkeypatch):
    """check_source reads a source's headers once per trust_remote_code; a source resolved again
    is checked again, and a source let go leaves nothing behind."""
    import gc

    from embedlens.io.source import resolve
    from embedlens.model import files

    reads: list[bool] = []

    def counted(*args: object, trust_remote_code: bool = False, **kwargs: object) -> object:
        reads.append(trust_remote_code)
        return real(*args, trust_remote_code=trust_remote_code, **kwargs)

    real = files.read_config
    monkeypatch.setattr(files, "read_config", counted)
    folder = str(tiny("llama-tied"))
    source = resolve(folder)
    for trust in (False, False, True, True):
        files.check_source(source, trust_remote_code=trust)
    assert reads == [False, True]
    again = resolve(folder)
    assert again == source
    files.check_source(again)
    assert reads == [False, True, False]
    key = id(source)
    del source
    gc.collect()
    assert key not in files._READ


def test_a_protobuf_lookup_does_not_hide_transformers_own_error(tiny):
    """transformers 5.0, failing to build a tokenizer, names protobuf's error class in an
    `except`; without protobuf that lookup raises ImportError over its own ValueError. The
    error said is the ValueError's (a folder without tokenizer.json), not a missing package."""
    from embedlens.errors import CheckpointError
    from embedlens.io.source import resolve
    from embedlens.model.load_errors import translated

    source = resolve(str(tiny("llama-tied")))
    own = "Couldn't instantiate the backend tokenizer from one of: (1) a tokenizers file"
    with pytest.raises(CheckpointError) as said, translated(source, "loading the tokenizer"):
        try:
            raise ValueError(own)
        except ValueError:
            raise ImportError("requires the protobuf library but it was not found") from None
    assert said.value.message == f"loading the tokenizer failed: {own}"
