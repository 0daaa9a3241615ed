"""A folder loaded without transformers' auto machinery is the model transformers loads.

The config and causal-LM class come from transformers' name tables, and a float32 model's weights
are assigned from the memory-mapped files (embedlens.compat.transformers.direct): on every family the config,
the class, every tensor and buffer, the tied weights, the loading info and the logits are
transformers' own; where transformers converts a tensor on the way (Qwen3-MoE's experts are
merged), from_pretrained loads it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from embedlens.compat.transformers import direct
from embedlens.io.source import resolve
from embedlens.model import loading
from tests.models import FAMILIES

CONVERTED = {"qwen3-moe"}  # transformers merges the experts' tensors as it loads them


def reference(folder: Path, config: Any) -> tuple[Any, dict[str, Any]]:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(  # type: ignore[no-any-return]
        str(folder),
        config=config,
        dtype=torch.float32,
        output_loading_info=True,
        ignore_mismatched_sizes=True,
    )


def assert_same_model(model: Any, expected: Any) -> None:
    """Every tensor (bit for bit, dtype included), tied weights, flags and logits alike."""
    import torch

    ours, theirs = model.state_dict(), expected.state_dict()
    assert list(ours) == list(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype, name
        assert torch.equal(ours[name], tensor), name
    params = dict(model.named_parameters(remove_duplicate=False))
    expected_params = dict(expected.named_parameters(remove_duplicate=False))
    assert {n: p.requires_grad for n, p in params.items()} == {
        n: p.requires_grad for n, p in expected_params.items()
    }
    assert len({id(p) for p in params.values()}) == len({id(p) for p in expected_params.values()})
    assert [n for n, _ in model.named_buffers()] == [n for n, _ in expected.named_buffers()]
    assert model.training == expected.training
    assert model.config.to_dict() == expected.config.to_dict()
    ids = torch.tensor([[1, 5, 9, 12, 3]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected(ids).logits)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_config_class_and_weights_are_transformers_own(tiny, family):
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tiny(family)
    config = direct.read_config(folder)
    assert config is not None
    assert config.to_dict() == AutoConfig.from_pretrained(folder).to_dict()
    found = direct.causal_lm_class(config)
    assert found is not None
    assert found[0] is type(AutoModelForCausalLM.from_config(config))
    files = direct.weight_files(folder, config)
    assert files == [folder / "model.safetensors"]
    loaded = direct.load_float32(folder, config, files)
    if family in CONVERTED:
        assert loaded is None
        return
    assert loaded is not None
    model, info = loaded
    expected, expected_info = reference(folder, config)
    assert info == expected_info
    assert_same_model(model, expected)


def test_a_sharded_checkpoint_is_read_from_its_shards(tiny):
    folder = tiny("llama-untied", max_shard_size="20KB")
    config = direct.read_config(folder)
    files = direct.weight_files(folder, config)
    assert files is not None and len(files) > 1
    loaded = direct.load_float32(folder, config, files)
    assert loaded is not None
    assert_same_model(loaded[0], reference(folder, config)[0])


def rewritten(tiny: Any, tmp: Path, change: Any) -> Path:
    """The tiny Llama with its tensors changed by `change(dict of tensors)`."""
    from safetensors.torch import load_file, save_file

    folder = tmp / "model"
    shutil.copytree(tiny("llama-untied"), folder)
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize(
    "change",
    [
        lambda t: t.update(extra=t["model.norm.weight"].clone()),  # a tensor the model lacks
        lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),  # a weight the checkpoint lacks
        lambda t: t.update(  # a weight in another shape
            {"model.norm.weight": t["model.norm.weight"][:-1].clone()}
        ),
        lambda t: t.update(  # saved from the bare model: names without the 'model.' prefix
            {k.removeprefix("model."): t.pop(k) for k in list(t) if k.startswith("model.")}
        ),
    ],
    ids=["unexpected", "missing", "mismatched", "no-prefix"],
)
def test_what_a_checkpoint_lacks_or_adds_is_reported_as_transformers_reports_it(
    tiny, tmp_path, change
):
    folder = rewritten(tiny, tmp_path, change)
    config = direct.read_config(folder)
    loaded = direct.load_float32(folder, config, [folder / "model.safetensors"])
    assert loaded is not None
    expected, expected_info = reference(folder, config)
    assert loaded[1] == expected_info
    ours, theirs = loaded[0].state_dict(), expected.state_dict()
    mended = expected_info["missing_keys"] | {m[0] for m in expected_info["mismatched_keys"]}
    import torch

    assert all(torch.equal(ours[k], v) for k, v in theirs.items() if k not in mended)


def test_the_lens_s_loading_takes_the_direct_way_for_a_float32_folder(tiny, monkeypatch):
    """No from_pretrained for a float32 folder; bfloat16, a GGUF or a conversion still use it."""
    from transformers import AutoModelForCausalLM

    calls: list[str] = []
    original = AutoModelForCausalLM.from_pretrained

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(str(kwargs.get("dtype")))
        return original(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", counted)
    source = resolve(str(tiny("llama-tied")))
    loading.load_model(source, dtype="float32")
    assert calls == []
    loading.load_model(source, dtype="bfloat16")
    loading.load_model(resolve(str(tiny("qwen3-moe"))), dtype="float32")
    assert calls == ["torch.bfloat16", "torch.float32"]


def test_params_meta_only_builds_transformers_class_without_the_auto_class(tmp_path):
    """DeepSeek-V3's config (671 B parameters) built on the meta device by its class directly:
    the same modules and shapes as AutoModelForCausalLM.from_config."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "deepseek"
    folder.mkdir()
    configs = Path(__file__).resolve().parent / "configs"
    (folder / "config.json").write_text((configs / "DeepSeek-V3.json").read_text())
    config = direct.read_config(folder)
    model = direct.build_on_meta(config)
    with torch.device("meta"):
        expected = AutoModelForCausalLM.from_config(config)
    assert type(model) is type(expected)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes == {n: tuple(p.shape) for n, p in expected.named_parameters()}


def test_repository_code_and_adapters_are_left_to_transformers(tiny, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny("llama-tied"), folder)
    config = direct.read_config(folder)
    (folder / "adapter_config.json").write_text("{}")
    assert direct.weight_files(folder, config) is None
    data = json.loads((folder / "config.json").read_text())
    data["auto_map"] = {"AutoConfig": "x.Config", "AutoModelForCausalLM": "x.Model"}
    (folder / "config.json").write_text(json.dumps(data))
    assert direct.read_config(folder) is None
    config.auto_map = data["auto_map"]
    assert direct.causal_lm_class(config) is None
