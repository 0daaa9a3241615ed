"""`params` and `tied` from Python: the same objects as `--json`, and loaded models read as they
are, never moved or changed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from embedlens.analysis.params import META_FALLBACK, params
from embedlens.analysis.tied import tied
from embedlens.errors import CheckpointError, SourceError, UnsupportedError, UsageError
from embedlens.options import LoadOptions
from tests.models import FAMILIES, write_config


def _load(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder)


def _state(model: Any) -> tuple[Any, ...]:
    """What must not change: every parameter's storage, dtype, device and grad flag, the mode."""
    return (
        [
            (name, p.data_ptr(), p.dtype, p.device, p.requires_grad)
            for name, p in model.named_parameters(remove_duplicate=False)
        ],
        model.training,
        [m.training for m in model.modules()],
    )


@pytest.mark.parametrize(
    ("family", "flags"),
    [
        ("llama-tied", ()),
        ("llama-untied", ("--per-block",)),
        ("qwen3-moe", ("--per-block",)),
        ("opt", ("--meta-only",)),
        ("phi3", ("--meta-only", "--per-block")),
    ],
)
def test_params_equals_the_cli(cli, tiny, family, flags):
    folder = tiny(family)
    report = params(folder, meta_only="--meta-only" in flags, per_block="--per-block" in flags)
    assert report.to_dict() == cli.json("params", folder, *flags)
    assert bool(report.blocks) is ("--per-block" in flags)


def test_params_without_weights_notes_the_meta_fallback(cli, tmp_path):
    folder = write_config(tmp_path / "config-only", FAMILIES["llama-untied"])
    report = params(str(folder))
    assert report.source == "meta"
    assert report.notes[0] == META_FALLBACK
    assert report.to_dict() == cli.json("params", folder)
    result = cli("params", folder)
    assert result.exit_code == 0
    assert "note: " + META_FALLBACK in " ".join(result.stderr.split())
    assert params(folder, meta_only=True).notes == []  # asked for: nothing to note


@pytest.mark.parametrize(
    ("family", "flags"),
    [
        ("llama-tied", ()),
        ("llama-untied", ()),
        ("qwen3", ("--meta-only",)),
        ("phi3", ("--meta-only",)),
    ],
)
def test_tied_equals_the_cli(cli, tiny, family, flags):
    folder = tiny(family)
    report = tied(str(folder), meta_only="--meta-only" in flags)
    assert report.to_dict() == cli.json("tied", folder, *flags)


@pytest.mark.slow
def test_params_and_tied_on_smollm2_equal_the_cli(cli, smollm2):
    report = params(smollm2)
    assert report.to_dict() == cli.json("params", smollm2)
    assert report.source == "header" and report.tied is True
    assert params(smollm2, per_block=True).to_dict() == cli.json("params", smollm2, "--per-block")
    assert tied(smollm2).to_dict() == cli.json("tied", smollm2)


@pytest.mark.parametrize("family", ["llama-tied", "llama-untied", "qwen3-moe", "opt", "gpt2"])
def test_params_on_a_loaded_model_equals_params_load(cli, tiny, family):
    folder = tiny(family)
    model = _load(folder)
    model.train()  # a mode the call must leave as it found it
    before = _state(model)
    report = params(model, per_block=True)
    assert _state(model) == before
    expected = cli.json("params", folder, "--load", "--per-block")
    got = report.to_dict()
    assert got["model"] == model.name_or_path == str(folder)
    assert got["source"] == "weights"
    assert got == expected


def test_params_names_a_loaded_model_without_a_path_by_its_class():
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(FAMILIES["llama-untied"])
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(raw.pop("model_type"), **raw))
    assert not model.name_or_path
    report = params(model)
    assert report.model == "LlamaForCausalLM"
    assert report.total == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", ["llama-tied", "llama-untied", "gpt2", "phi"])
def test_tied_on_a_loaded_model(cli, tiny, family):
    folder = tiny(family)
    model = _load(folder)
    before = _state(model)
    report = tied(model)
    assert _state(model) == before
    embed = model.get_input_embeddings().weight
    same = model.get_output_embeddings().weight.data_ptr() == embed.data_ptr()
    assert report.tied is same is FAMILIES[family]["tie_word_embeddings"]
    assert report.evidence.same_storage is same
    assert report.evidence.checkpoint_has_lm_head is None  # no checkpoint was read
    assert report.evidence.config is FAMILIES[family]["tie_word_embeddings"]
    assert "data_ptr()" in report.verdict
    got, expected = report.to_dict(), cli.json("tied", folder, "--load")
    expected["evidence"]["checkpoint_has_lm_head"] = None
    assert got == expected


def test_tied_on_a_model_built_on_meta(cli, tiny):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    for family in ("qwen3", "phi3"):
        folder = tiny(family)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
        report = tied(model)
        # transformers 5.0's from_config on meta leaves the two parameters apart (5.24 ties
        # them): the answer is the object's, whatever the config says
        same = model.get_input_embeddings().weight is model.get_output_embeddings().weight
        assert report.tied is same
        assert "identity" in report.verdict
        assert params(model).source == "meta"
        expected = cli.json("tied", folder, "--meta-only")
        if same is expected["tied"]:
            assert report.evidence == type(report.evidence)(**expected["evidence"])
        else:  # the config ties them, the object does not
            assert not report.consistent
            assert "the evidence disagrees: config=True, same_storage=False" in report.notes


@pytest.mark.parametrize(
    "options",
    [{"meta_only": True}, {"load": LoadOptions()}, {"revision": "main"}, {"dtype": "float16"}],
)
def test_options_for_reading_a_model_are_refused_with_a_loaded_one(tiny, options):
    model = _load(tiny("llama-tied"))
    before = _state(model)
    for run in (params, tied):
        with pytest.raises(UsageError, match="already loaded"):
            run(model, **options)
    assert _state(model) == before


def test_errors_raise_embedlens_errors(tiny, tmp_path, smollm2):
    from transformers import AutoModel

    folder = tiny("llama-tied")
    for run in (params, tied):
        with pytest.raises(UsageError, match="exclude each other"):
            run(folder, meta_only=True, load=LoadOptions())
        with pytest.raises(UsageError, match="unknown device"):
            run(folder, device="tpu")
        with pytest.raises(UsageError, match="unknown dtype"):
            run(folder, dtype="int3")
        with pytest.raises(UsageError, match="not int"):
            run(42)  # type: ignore[arg-type]
        with pytest.raises(UnsupportedError, match="no LM head"):
            run(AutoModel.from_pretrained(folder))
        with pytest.raises(SourceError):
            run(tmp_path / "missing")
    with pytest.raises(UsageError, match=r"needs a config\.json"):
        params(smollm2, meta_only=True)
    with pytest.raises(CheckpointError, match="no safetensors or GGUF weights"):
        tied(write_config(tmp_path / "config-only", FAMILIES["llama-tied"]))


@pytest.mark.slow
def test_header_mode_from_python_imports_no_torch(tiny):
    folder = tiny("llama-untied")
    code = (
        "import sys\n"
        "from embedlens.analysis.params import params\n"
        "from embedlens.analysis.tied import tied\n"
        f"print(params({str(folder)!r}).to_json())\n"
        f"assert tied({str(folder)!r}).tied is False\n"
        "print('HEAVY', [m for m in ('torch', 'transformers') if m in sys.modules])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert json.loads(out[0])["source"] == "header"
    assert out[-1] == "HEAVY []"
