"""`embedlens.analysis.lens.lens` from Python: the same report as `embedlens lens --json`, on a
model given by its path or already loaded (which it must leave exactly as it found it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from embedlens.analysis.lens import lens
from embedlens.errors import (
    ConfigError,
    EmbedlensError,
    NumericError,
    SourceError,
    UsageError,
)

PROMPT = "the king of France is"


def _load(folder: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(folder)


def _without_model(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k != "model"}


# --- the API gives the CLI's --json ---------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "args"),
    [
        ({}, []),
        (
            {"target": "queen", "position": "all", "layers": "0,2:", "top_k": 3},
            ["--target", "queen", "--position", "all", "--layers", "0,2:", "-k", "3"],
        ),
        ({"layers": [0, -1], "position": 2}, ["--layers", "0,-1", "--position", "2"]),
        (
            {"chat": "hello", "template_args": {"flag": True}},
            ["--chat", "hello", "--template-arg", "flag=true"],
        ),
    ],
)
def test_to_dict_is_the_cli_json(tiny, cli, kwargs, args):
    folder = tiny("llama-tied")
    report = lens(folder, PROMPT, **kwargs)
    assert report.to_dict() == cli.json("lens", folder, PROMPT, *args)
    assert json.loads(report.to_json()) == report.to_dict()


@pytest.mark.slow  # draws with matplotlib
def test_grid_for_a_plot_is_the_cli_plot_json(tiny, cli, tmp_path):
    """grid=True computes the layer x position grid at one position, as --plot does."""
    folder = tiny("gpt2")
    report = lens(folder, PROMPT, grid=True)
    assert report.grid is not None and len(report.grid[0].cells) == len(report.tokens)
    shown = cli.json("lens", folder, PROMPT, "--plot", tmp_path / "lens.svg")
    assert report.to_dict() == shown


@pytest.mark.slow
def test_smollm2_to_dict_is_the_cli_json(smollm2, cli):
    """On the real GGUF, with a --target typed without its leading space: the note the CLI
    prints on stderr is in report.notes (and so in the JSON)."""
    prompt = "The capital of France is"
    args = ["--target", "Paris", "--layers", "0,10:"]
    report = lens(smollm2, prompt, target="Paris", layers="0,10:")
    assert report.check.ok
    shown = cli("lens", smollm2, prompt, *args, "--json")  # one run: its stdout and its stderr
    assert shown.exit_code == 0, (shown.exit_code, shown.stdout, shown.stderr)
    assert report.to_dict() == json.loads(shown.stdout)
    said = [n for n in report.notes if n.startswith("--target 'Paris'")]
    assert said, report.notes
    assert "note: " + said[0] in shown.stderr


# --- a loaded model -------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama-tied", "gpt2", "opt", "gemma2", "qwen3-moe"])
def test_loaded_model_gives_what_its_checkpoint_gives(tiny, family):
    """The key promise: the lens on a model already loaded (float32) is the lens on its files."""
    folder = tiny(family)
    model, tokenizer = _load(folder)
    asked = {"position": "all", "target": "queen", "top_k": 4}
    on_files = lens(folder, PROMPT, **asked).to_dict()
    on_model = lens(model, PROMPT, tokenizer=tokenizer, **asked).to_dict()
    assert on_model["model"] == str(folder)  # model.name_or_path
    assert _without_model(on_model) == _without_model(on_files)
    assert on_model["check"]["ok"]


def _hooks(model: torch.nn.Module) -> list[tuple[str, str, tuple[Any, ...]]]:
    names = (
        "_forward_hooks",
        "_forward_pre_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_pre_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_backward_hooks",
        "_backward_pre_hooks",
        "_state_dict_hooks",
        "_load_state_dict_pre_hooks",
    )
    return [
        (module_name, attr, tuple(getattr(module, attr, {}).items()))
        for module_name, module in model.named_modules()
        for attr in names
    ]


def _global_hooks() -> list[int]:
    from torch.nn.modules import module

    return [
        len(getattr(module, name))
        for name in dir(module)
        if name.startswith("_global_") and name.endswith("hooks")
    ]


def _state(model: torch.nn.Module) -> dict[str, Any]:
    return {
        "params": {n: (p.detach().clone(), p.data_ptr()) for n, p in model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "dtypes": {n: p.dtype for n, p in model.named_parameters()},
        "devices": {n: p.device for n, p in model.named_parameters()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "training": {n: m.training for n, m in model.named_modules()},
        "modules": [(n, id(m)) for n, m in model.named_modules()],
        "hooks": _hooks(model),
        "global_hooks": _global_hooks(),
    }


def _same_state(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before["params"].keys() == after["params"].keys()
    for name, (value, ptr) in before["params"].items():
        now, now_ptr = after["params"][name]
        assert ptr == now_ptr, name
        assert torch.equal(value, now), name
    for name, value in before["buffers"].items():
        assert torch.equal(value, after["buffers"][name]), name
    for key in ("dtypes", "devices", "requires_grad", "training", "modules", "hooks"):
        assert before[key] == after[key], key
    assert before["global_hooks"] == after["global_hooks"]


@pytest.mark.parametrize("family", ["llama-tied", "gpt2"])
def test_loaded_model_is_left_as_it_was(tiny, family):
    """Weights, dtype, device, training flags (mixed ones too) and hooks are all unchanged; the
    run itself is in eval mode (it equals the run on the files)."""
    folder = tiny(family)
    model, tokenizer = _load(folder)
    model.train()
    first = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))
    first.eval()  # a mix of flags, restored module by module
    seen: list[int] = []
    model.register_forward_hook(lambda *_: seen.append(1))  # the user's own hook stays
    grad_before = torch.is_grad_enabled()
    before = _state(model)
    report = lens(model, PROMPT, tokenizer=tokenizer, position="all", target="queen")
    _same_state(before, _state(model))
    assert model.training and not first.training
    assert torch.is_grad_enabled() == grad_before
    assert seen  # the user's hook ran with the model, and is still registered
    on_files = lens(folder, PROMPT, position="all", target="queen")
    assert _without_model(report.to_dict()) == _without_model(on_files.to_dict())
    assert torch.is_grad_enabled() == grad_before  # loading from files leaves autograd alone


def test_loaded_model_name_is_the_class_without_a_path(tiny):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = tiny("llama-tied")
    config = AutoConfig.from_pretrained(folder)
    config.name_or_path = ""  # a model built from a config alone has no path
    model = AutoModelForCausalLM.from_config(config)
    report = lens(model, PROMPT, tokenizer=AutoTokenizer.from_pretrained(folder))
    assert report.model == type(model).__name__ == "LlamaForCausalLM"
    assert report.dtype == "float32"


def test_loaded_model_keeps_its_dtype(tiny):
    """A bfloat16 model runs in bfloat16: the lens does not re-type it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny("llama-tied")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    report = lens(model, PROMPT, tokenizer=AutoTokenizer.from_pretrained(folder))
    assert report.dtype == "bfloat16"
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    on_files = lens(folder, PROMPT, dtype="bfloat16")
    assert _without_model(report.to_dict()) == _without_model(on_files.to_dict())


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"prompt": ""}, "the prompt is empty"),
        ({"top_k": 0}, "-k must be at least 1"),
        ({"layers": "1-2"}, "malformed --layers '1-2'"),
        ({"layers": [9]}, "layer 9 is out of range"),
        ({"layers": ["0"]}, "layers must be layer numbers"),
        ({"layers": []}, "selects no layer"),
        ({"position": "first"}, "--position must be an integer or 'all'"),
        ({"position": 99}, "position 99 is out of range"),
        ({"target": "zebra"}, "'zebra' is not in the vocabulary"),
        ({"no_thinking": True}, "only apply with --chat"),
        ({"template_args": ["novalue"]}, "malformed --template-arg"),
        ({"device_map": "everywhere"}, "unknown --device-map 'everywhere'"),
        ({"max_memory": "cpu=1GB"}, "only apply with --device-map"),
        ({"device_map": "auto", "max_memory": "cpu=lots"}, "'lots' is not a size"),
        ({"dtype": "float8"}, "unknown dtype 'float8'"),
        ({"device": "tpu"}, "unknown device 'tpu'"),
    ],
)
def test_bad_input_is_a_usage_error(tiny, kwargs, says):
    args = {"prompt": PROMPT, **kwargs}
    prompt = args.pop("prompt")
    with pytest.raises(UsageError) as info:
        lens(tiny("llama-tied"), prompt, **args)
    assert says in info.value.message


def test_missing_model_is_a_source_error(tmp_path):
    with pytest.raises(SourceError):
        lens(tmp_path / "no-such-model", PROMPT)


def test_broken_config_is_a_config_error(tiny, tmp_path):
    import shutil

    folder = tmp_path / "broken"
    shutil.copytree(tiny("llama-tied"), folder)
    (folder / "config.json").write_text("{")
    with pytest.raises(ConfigError):
        lens(folder, PROMPT)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"tokenizer": None}, "needs its tokenizer"),
        ({"dtype": "bfloat16"}, "dtype applies only when embedlens loads the model"),
        ({"device": "auto", "revision": "main"}, "revision, device apply only"),
        ({"device_map": "auto"}, "device_map applies only"),
        ({"trust_remote_code": True}, "trust_remote_code applies only"),
    ],
)
def test_loaded_model_refuses_loading_options(tiny, kwargs, says):
    folder = tiny("llama-tied")
    model, tokenizer = _load(folder)
    args = {"tokenizer": tokenizer, **kwargs}
    with pytest.raises(UsageError) as info:
        lens(model, PROMPT, **args)
    assert says in info.value.message


def test_not_a_model_is_a_usage_error(tiny):
    _, tokenizer = _load(tiny("llama-tied"))
    with pytest.raises(UsageError, match="not int"):
        lens(42, PROMPT, tokenizer=tokenizer)  # type: ignore[arg-type]


def test_model_that_gives_nan_is_a_numeric_error(tiny):
    """A loaded model with a NaN weight: NumericError (an EmbedlensError), never a table."""
    model, tokenizer = _load(tiny("llama-tied"))
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    with pytest.raises(NumericError) as info:
        lens(model, PROMPT, tokenizer=tokenizer)
    assert isinstance(info.value, EmbedlensError)


def test_the_typed_keywords_are_the_option_objects_fields():
    """`**keywords: Unpack[LensKeywords]` shows type checkers every field `lens`,
    `lens_prompts` and `lens_states` take as a keyword (`LoadKeywords`: `lens_text`, `tune`):
    exactly the fields of LoadOptions (but its source) and LensOptions."""
    import inspect
    import typing

    import embedlens
    from embedlens.options import LENS_FIELDS, LOAD_FIELDS, LensKeywords, LoadKeywords

    assert set(typing.get_type_hints(LoadKeywords)) == LOAD_FIELDS
    assert set(typing.get_type_hints(LensKeywords)) == LOAD_FIELDS | LENS_FIELDS
    for function in (embedlens.lens, embedlens.lens_prompts, embedlens.lens_states):
        assert "Unpack[LensKeywords]" in str(inspect.signature(function).parameters["keywords"])
