"""embedlens' shortcuts over transformers' private parts, and the gate in front of them.

- `direct`: a safetensors folder's config, meta model and float32 weights without the auto
  classes' per-tensor machinery;
- `direct_tokenizer`: a folder's tokenizer.json through `tokenizers`, as transformers' generic
  class reads it;
- `gguf_patches`: one parse of a GGUF file shared by transformers' config, tokenizer and weights;
- `import_scan`: transformers' model table scanned once on import.

Each is taken only on the transformers releases CI runs them on (`FAST_RELEASES`) and where the
private parts it uses are still as written here (`FAST_SIGNATURES`, `FAST_KEYWORDS`,
`FAST_NAMES`); elsewhere, and with EMBEDLENS_PLAIN=1, embedlens goes through transformers' public
API (`AutoConfig`, `AutoModelForCausalLM`, `AutoTokenizer`): slower, the same figures.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

from embedlens.compat import checked_release, forget_said, release_text, say_once

FAST_RELEASES = ((5, 24), (5, 26))
"""transformers releases the shortcuts are taken on: from the first, up to the second (5.24.x
and 5.25.x, each checked by CI's faithfulness tests)."""
NEWEST_TESTED = "5.25.0"
"""The newest transformers release CI runs: the one to install when another misreads a file."""
LOWEST_TESTED = "5.0"
"""The lowest transformers release CI runs (pyproject.toml's lower bound)."""

FAST_SIGNATURES: dict[str, tuple[str, ...]] = {
    "transformers.configuration_utils:PretrainedConfig.get_config_dict": (
        "pretrained_model_name_or_path",
    ),
    "transformers.modeling_utils:_get_dtype": (
        "dtype", "checkpoint_files", "config", "sharded_metadata", "state_dict", "weights_only",
        "hf_quantizer",
    ),
    "transformers.modeling_utils:PreTrainedModel.get_init_context": (
        "dtype", "is_quantized", "_is_ds_init_called", "allow_all_kernels",
    ),
    "transformers.modeling_utils:PreTrainedModel._get_dtype_plan": ("self", "dtype"),
    "transformers.modeling_utils:PreTrainedModel._finalize_model_loading": (
        "model", "load_config", "loading_info",
    ),
    "transformers.modeling_utils:PreTrainedModel.set_use_kernels": (
        "self", "use_kernels", "kernel_config",
    ),
    "transformers.core_model_loading:rename_source_key": (
        "source_key", "weight_renamings", "weight_converters", "base_model_prefix",
        "meta_state_dict",
    ),
    "transformers.core_model_loading:set_param_for_module": (
        "model", "target_name", "param_value", "loading_info", "hf_quantizer",
    ),
    "transformers.conversion_mapping:get_model_conversion_mapping": (
        "model", "key_mapping", "hf_quantizer",
    ),
    "transformers.monkey_patching:patch_output_recorders": ("model",),
    "transformers.utils.generic:ContextManagers": ("context_managers",),
}  # fmt: skip
"""The private functions the weights' shortcut calls, with the parameters it passes them (in
order)."""

FAST_KEYWORDS: dict[str, tuple[str, ...]] = {
    "transformers.modeling_utils:LoadStateDictConfig": (
        "pretrained_model_name_or_path", "ignore_mismatched_sizes", "dtype", "weight_mapping",
    ),
    "transformers.utils.loading_report:LoadStateDictInfo": (
        "missing_keys", "unexpected_keys", "mismatched_keys", "conversion_errors", "error_msgs",
        "skipped_pp_keys",
    ),
    "transformers.modeling_utils:log_state_dict_report": ("loading_info",),
}  # fmt: skip
"""Private functions and classes the weights' shortcut calls with keyword arguments."""

FAST_NAMES: dict[str, tuple[str, ...]] = {
    "transformers.models.auto.configuration_auto": (
        "CONFIG_MAPPING_NAMES", "model_type_to_module_name",
    ),
    "transformers.models.auto.modeling_auto": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",),
    "transformers.core_model_loading": ("WeightConverter", "WeightRenaming"),
}  # fmt: skip
"""Tables and classes the config, model and weights shortcuts read by name."""

TOKENIZER_NAMES: dict[str, tuple[str, ...]] = {
    "transformers.models.auto.tokenization_auto": (
        "TOKENIZER_MAPPING_NAMES",
        "MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS",
    ),
}
"""Tables the tokenizer shortcut reads by name."""

_verdicts: dict[str, bool] = {}


def installed_transformers() -> str | None:
    """The installed transformers release as it names itself (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return None


def release_key(text: str) -> tuple[int, ...]:
    """A release's leading numbers ('5.24.0' -> (5, 24, 0); '5.25.0.dev0' -> (5, 25, 0)), for
    comparing releases: at least three ('5.24' is '5.24.0')."""
    found = re.match(r"\d+(?:\.\d+)*", text.strip())
    numbers = tuple(int(part) for part in found.group(0).split(".")) if found else ()
    return numbers + (0,) * (3 - len(numbers))


def release_fits() -> bool:
    """Whether the shortcuts may be taken as far as EMBEDLENS_PLAIN and the installed release
    tell, without importing transformers (what `fast` checks first)."""
    return bool(_fits())


def _fits() -> bool | None:
    """Whether the installed release is one of FAST_RELEASES; None under EMBEDLENS_PLAIN."""
    return checked_release("transformers", *FAST_RELEASES)


def fast_releases() -> str:
    """FAST_RELEASES as a message says them: '5.24.x and 5.25.x'."""
    (major, low), (_, high) = FAST_RELEASES
    names = [f"{major}.{minor}.x" for minor in range(low, high)]
    return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def fast(part: str = "model") -> bool:
    """Whether a shortcut over transformers may be taken in this process: `model` (config,
    meta model and weights: `direct`), `tokenizer` (`direct_tokenizer`), `gguf`
    (`gguf_patches`, which checks its own signatures). Not with
    EMBEDLENS_PLAIN=1; only on a release in FAST_RELEASES whose private parts are as this module
    lists them. Where they are not, one note says so (not under EMBEDLENS_PLAIN). Decided once
    per process and part."""
    fits = _fits()
    if fits is None:
        return False
    if part not in _verdicts:
        why = _why_not(part, fits)
        if why is not None:
            say_once(
                f"transformers {release_text('transformers')}: {why}; loading goes through "
                "transformers' public API (slower, the same figures)"
            )
        _verdicts[part] = why is None
    return _verdicts[part]


def _why_not(part: str, fits: bool) -> str | None:
    """Why a part's shortcuts may not be taken (None: they may); `fits`, whether the installed
    release is one of FAST_RELEASES."""
    if not fits:
        return (
            f"embedlens' loading shortcuts are checked on transformers {fast_releases()} only "
            f"(CI tests {LOWEST_TESTED} to {NEWEST_TESTED})"
        )
    signatures: dict[str, tuple[str, ...]] = {}
    keywords: dict[str, tuple[str, ...]] = {}
    names: dict[str, tuple[str, ...]] = {}
    if part == "model":
        signatures, keywords, names = FAST_SIGNATURES, FAST_KEYWORDS, FAST_NAMES
    elif part == "tokenizer":
        names = TOKENIZER_NAMES
    for where, params in signatures.items():
        if not signature_starts(where, params):
            return f"{where.replace(':', '.')} is not what embedlens' loading shortcuts expect"
    for where, params in keywords.items():
        if not takes(where, params):
            return f"{where.replace(':', '.')} is not what embedlens' loading shortcuts expect"
    for module_name, wanted in names.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            return f"{module_name} is missing"
        missing = [name for name in wanted if not hasattr(module, name)]
        if missing:
            return f"{module_name} has no {', '.join(missing)}"
    return None


def find(where: str) -> Any | None:
    """'module:Qualified.name' imported (None where the module or a name is missing)."""
    module_name, _, qualname = where.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError:
        return None
    for part in qualname.split("."):
        found = getattr(found, part, None)
        if found is None:
            return None
    return found


def signature_starts(where: str, params: tuple[str, ...]) -> bool:
    """Whether the function (or class) at `where` takes `params` first, in this order."""
    names = _parameters(where)
    return names is not None and names[: len(params)] == list(params)


def _parameters(where: str) -> list[str] | None:
    """The parameter names of the function (or class) at `where`; None where there is none."""
    found = find(where)
    if found is None or not callable(found):
        return None
    try:
        return list(inspect.signature(found).parameters)
    except (TypeError, ValueError):
        return None


def takes(where: str, names: tuple[str, ...]) -> bool:
    """Whether the function (or class) at `where` takes each of `names` as a keyword."""
    params = _parameters(where)
    return params is not None and all(name in params for name in names)


def forget() -> None:
    """Decide again at the next `fast()`, and say its note again (tests change what it
    depends on)."""
    _verdicts.clear()
    forget_said()
