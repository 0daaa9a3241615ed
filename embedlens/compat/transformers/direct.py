"""A safetensors folder loaded the way transformers loads it, without its auto machinery.

The config class and the causal-LM class come from transformers' own name tables
(`CONFIG_MAPPING_NAMES`, `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`: which class a model type means,
without importing every model), and the weights of a frozen float32 model are assigned from the
memory-mapped files with transformers' own steps (its init context, renaming rules and
finalisation) but without its per-tensor conversion machinery, which costs more than the copy
itself. Every function returns None where transformers would do something more (remote code, a
quantised or converted checkpoint, a class the tables do not settle), and every entry
(`read_config`, `build_on_meta`, `load_folder`, `early_files`) where the gate in
`embedlens.compat.transformers` closes the shortcuts (another release, EMBEDLENS_PLAIN=1): the
caller then goes through transformers' public API (`AutoConfig`, `AutoModelForCausalLM`).

While the main thread imports transformers and builds the model on the meta device, a folder's
bfloat16 and float16 tensors are copied to float32 on a second thread (`copies_for`, `Prefetch`):
on SmolLM2 and Qwen3-0.6B the copies are a third of the load, and the imports and the build leave
the second core idle. They are the elementwise conversions `Tensor.to(torch.float32)` makes
(exact: every bfloat16 and float16 value is a float32 value), run by torch's batched copy
(`_foreach_copy_`, which holds no GIL) on pieces of torch's grain size, which torch never splits
between threads: the same bits whichever thread made them, on one core without the thread setting
torch's thread count (the main thread's to set). A call copies a few pieces, so that a load that
ends early (`close`) waits for one call at most.

Like `loading`, nothing here imports torch or transformers at module level.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from embedlens.compat.transformers import fast, release_fits

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


def read_config(folder: Path) -> Any | None:
    """What `AutoConfig.from_pretrained(folder)` returns for a built-in model type, from the
    config class the model type names; None for repository code or a type transformers lacks."""
    from transformers import PretrainedConfig

    if not fast():
        return None
    where = str(folder)
    raw, unused = PretrainedConfig.get_config_dict(where, _from_auto=True, name_or_path=where)
    auto_map = raw.get("auto_map")
    if isinstance(auto_map, dict) and "AutoConfig" in auto_map:
        return None
    model_type = raw.get("model_type")
    if model_type == "mistral" and "layer_types" in raw:
        raw["model_type"] = model_type = "ministral"  # as AutoConfig does
    config_class = _config_class(model_type)
    if config_class is None:
        return None
    return config_class.from_dict(raw, **unused)


def _config_class(model_type: object) -> Any | None:
    """The config class transformers maps a model type to (None if it maps none)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING_NAMES:
        return None
    return _from_model_module(model_type, CONFIG_MAPPING_NAMES[model_type])


def _from_model_module(model_type: str, name: str) -> Any:
    """A class by name from the model type's package (or transformers' top level), as the auto
    mappings find it."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    module = importlib.import_module(
        f".{model_type_to_module_name(model_type)}", "transformers.models"
    )
    if hasattr(module, name):
        return getattr(module, name)
    return getattr(importlib.import_module("transformers"), name)


def causal_lm_class(config: Any) -> tuple[Any, Any] | None:
    """The class `AutoModelForCausalLM` builds for a built-in config, and the config it is given
    (a multimodal config's text part when the class takes that); None where the auto class would
    look further (repository code, classes registered at run time, no causal LM). Behind the
    gate of its callers' entry (`build_on_meta`, `load_folder`'s `weight_files`)."""
    from transformers.models.auto import modeling_auto

    auto_map = getattr(config, "auto_map", None)
    if isinstance(auto_map, dict) and "AutoModelForCausalLM" in auto_map:
        return None
    if getattr(modeling_auto.AutoModelForCausalLM._model_mapping, "_extra_content", None):
        return None
    kind = type(config)
    found = _causal_names(kind.__name__) if kind.__module__.startswith("transformers.") else None
    if found is None:
        return None
    model_class = _chosen(config, *found)
    text_class = config.sub_configs.get("text_config", None)
    if text_class is not None and getattr(model_class, "config_class", None) == text_class:
        if getattr(config, "quantization_config", None) is not None:
            return None
        config = config.get_text_config()
    return model_class, config


def _causal_names(config_name: str) -> tuple[str, str | tuple[str, ...]] | None:
    """(model type, causal-LM class name or names) for a config class, found as the auto
    mapping finds it: the last model type of that config class first, then the others."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = [t for t, name in CONFIG_MAPPING_NAMES.items() if name == config_name]
    for model_type in types[-1:] + types:
        if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            return model_type, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    return None


def _chosen(config: Any, model_type: str, names: str | tuple[str, ...]) -> Any:
    """One class of a model type's entry: the one `architectures` names, else the first."""
    if isinstance(names, str):
        return _from_model_module(model_type, names)
    classes = [_from_model_module(model_type, name) for name in names]
    by_name = {c.__name__: c for c in classes}
    for arch in getattr(config, "architectures", None) or []:
        if arch in by_name:
            return by_name[arch]
    return classes[0]


def build_on_meta(config: Any) -> Any | None:
    """`AutoModelForCausalLM.from_config(config)` on the meta device (no memory, no weights);
    None where the auto class would look further."""
    found = causal_lm_class(config) if fast() else None
    if found is None:
        return None
    import torch

    model_class, config = found
    with torch.device("meta"):
        return model_class._from_config(config)


def load_folder(
    folder: Path, config: Any, early: Prefetch | None = None
) -> tuple[Any, dict[str, Any]] | None:
    """A folder's float32 model and loading info read directly (`load_float32` of its
    `weight_files`), or None where transformers' from_pretrained is needed; the copies of
    `early` not taken are let go of either way (before from_pretrained holds its own)."""
    try:
        files = weight_files(folder, config)
        return None if files is None else load_float32(folder, config, files, early)
    finally:
        if early is not None:
            early.close()


def weight_files(folder: Path, config: Any) -> list[Path] | None:
    """The safetensors files `from_pretrained(folder)` reads, when it reads them plainly: one
    file or the shards of an index; None for anything else (an adapter, a distributed or
    explicitly named checkpoint, extra files, pickles)."""
    if not fast() or (folder / "adapter_config.json").exists() or _distributed(folder):
        return None
    if getattr(config, "transformers_weights", None) or type(config).extra_files:
        return None
    return safetensors_files(folder)


def early_files(
    folder: Path | None, raw: dict[str, Any] | None, trust_remote_code: bool
) -> list[Path] | None:
    """`weight_files` as far as config.json read as JSON (`raw`, as embedlens read it) tells,
    before transformers is imported: None also where the direct load surely does not apply (a
    quantised checkpoint, repository code the caller trusts)."""
    if folder is None or not release_fits() or (folder / "adapter_config.json").exists():
        return None
    if raw is None or raw.get("quantization_config") is not None:
        return None
    if trust_remote_code and raw.get("auto_map"):
        return None
    return safetensors_files(folder)


def safetensors_files(folder: Path) -> list[Path] | None:
    """The folder's one safetensors file, or the shards its index names; None otherwise."""
    if (folder / WEIGHTS).is_file():
        return [folder / WEIGHTS]
    index = folder / WEIGHTS_INDEX
    if not index.is_file():
        return None
    weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    if not isinstance(weight_map, dict):
        return None
    return [folder / name for name in sorted(set(weight_map.values()))]


def _distributed(folder: Path) -> bool:
    """Whether transformers would read the folder as a distributed (DCP) checkpoint."""
    try:
        from transformers.distributed.checkpoint import is_sharded_checkpoint
    except ImportError:  # a transformers without distributed checkpoints
        return False
    return bool(is_sharded_checkpoint(str(folder)))


def load_float32(
    folder: Path, config: Any, files: list[Path], early: Prefetch | None = None
) -> tuple[Any, dict[str, Any]] | None:
    """`AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32,
    output_loading_info=True, ignore_mismatched_sizes=True)`, the same model and loading info,
    its tensors read from the memory-mapped files and assigned in place; None (nothing loaded)
    when transformers would convert a tensor on the way (merge, split, transpose), quantise, or
    keep some modules in another dtype. The generation config is not read: the lens never
    generates. `early`: float32 copies of the tensors already begun (`copies_for`)."""
    if getattr(config, "quantization_config", None) is not None:
        return None
    found = causal_lm_class(config)
    if found is None:
        return None
    model_class, config = found
    where = str(folder)
    model, dtype = _built(model_class, config, where)
    if model._get_dtype_plan(dtype):
        return None
    plan = plan_targets(model, files)
    if plan is None:
        return None
    info = _assign(model, plan, dtype, early)
    return model, _finalised(model_class, model, info, where, dtype, plan.conversions)


def _built(model_class: Any, config: Any, where: str) -> tuple[Any, Any]:
    """The model on the meta device, under the init context from_pretrained uses."""
    import torch
    from transformers import modeling_utils
    from transformers.monkey_patching import patch_output_recorders
    from transformers.utils.generic import ContextManagers

    config = copy.deepcopy(config)
    config, dtype = modeling_utils._get_dtype(torch.float32, None, config, None, None, True, None)
    config.name_or_path = where
    config = copy.deepcopy(config)
    with ContextManagers(model_class.get_init_context(dtype, False, False, False)):
        model = model_class(config)
        patch_output_recorders(model)
    return model, dtype


class Plan:
    """Which checkpoint tensor goes to which model tensor, and what the checkpoint holds beyond."""

    def __init__(self, conversions: list[Any]) -> None:
        self.conversions = conversions
        self.targets: dict[str, tuple[Path, str]] = {}
        self.unexpected: set[str] = set()


def plan_targets(model: Any, files: list[Path]) -> Plan | None:
    """Each checkpoint tensor's target as transformers renames it; None when a conversion (not
    just a new name) applies, or two tensors go to one place."""
    from safetensors import safe_open

    keyed = []
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            keyed.append((path, list(handle.keys())))
    return plan_keys(model, keyed)


def plan_keys(model: Any, keyed: list[tuple[Path, list[str]]]) -> Plan | None:
    """`plan_targets` on the tensor names of each file, as its header gives them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    conversions = get_model_conversion_mapping(model, None, None)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    meta = model.state_dict()
    prefix = model.base_model_prefix
    plan = Plan(conversions)
    for path, keys in keyed:
        for key in keys:
            target, pattern = rename_source_key(key, renamings, converters, prefix, meta)
            if target not in meta and key in meta:
                target, pattern = rename_source_key(key, [], [], prefix, meta)
            if pattern is not None or target in plan.targets:
                return None
            if target in meta:
                plan.targets[target] = (path, key)
            else:
                plan.unexpected.add(target)
    return plan


def _assign(model: Any, plan: Plan, dtype: Any, early: Prefetch | None) -> Any:
    """Read each planned tensor (as float32, or its own dtype for integer buffers) into its
    place, as transformers' set_param_for_module does, taking the copies `early` made; the
    loading info of what was not."""
    from safetensors import safe_open
    from transformers.core_model_loading import set_param_for_module
    from transformers.utils.loading_report import LoadStateDictInfo

    meta = model.state_dict()
    info = LoadStateDictInfo(
        missing_keys=set(meta),
        unexpected_keys=set(plan.unexpected),
        mismatched_keys=set(),
        conversion_errors={},
        error_msgs=[],
        skipped_pp_keys=set(),
    )
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for target, (path, key) in plan.targets.items():
        by_file.setdefault(path, []).append((target, key))
    with _one_thread():
        for path, pairs in by_file.items():
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                for target, key in pairs:
                    # float32 (the model's dtype), or a buffer's own (an integer buffer stays one)
                    wanted = meta[target].dtype
                    value = None if early is None else early.take(path, key, wanted)
                    if value is None:
                        value = handle.get_slice(key)[...].to(device="cpu", dtype=wanted)
                    set_param_for_module(model, target, value, info, None)  # type: ignore[arg-type]
    return info


@contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one thread while tensors are copied (elementwise: the values do not depend on
    it). A copy is bound by the fresh pages it touches, and threads splitting it only contend:
    measured on 2 busy cores, SmolLM2's tensors to float32 in 0.6 s on one thread, 2 to 3.5 s on
    two (transformers' own loader, copying in a pool of worker threads, took 0.6 s)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _finalised(
    model_class: Any, model: Any, info: Any, where: str, dtype: Any, conversions: list[Any]
) -> dict[str, Any]:
    """from_pretrained's last steps: buffers and tied weights set, keys the class ignores
    dropped, eval mode; the loading info as `output_loading_info` gives it."""
    from transformers.modeling_utils import LoadStateDictConfig

    model._weight_conversions = [c for c in conversions if c.was_used()]
    load_config = LoadStateDictConfig(
        pretrained_model_name_or_path=where,
        ignore_mismatched_sizes=True,
        dtype=dtype,
        weight_mapping=conversions,
    )
    info = model_class._finalize_model_loading(model, load_config, info)
    model.eval()
    model.set_use_kernels(False, None)
    result: dict[str, Any] = info.to_dict()
    return result


# --- a folder's half-precision weights copied to float32 on a second thread ---

CONVERTED = ("BF16", "F16")
"""safetensors dtypes that the load converts to float32 (a float32 tensor is used as it is read)."""
PIECE = 2**15
"""Elements a copy converts at once: torch's grain size (`at::internal::GRAIN_SIZE`), up to which
an elementwise op runs on the calling thread alone (were it smaller in another torch release, a
piece would be split between threads: the same bits, at another speed)."""
PER_CALL = 64
"""Pieces copied by one call of the thread (2 Mi elements): a stop is seen between calls."""


def worth_it() -> bool:
    """Whether a second thread can run beside the main one: this process may use more than one
    core (a fact of the machine, not of its load; on one core the copies would only take turns
    with the imports)."""
    try:
        return len(os.sched_getaffinity(0)) > 1
    except (AttributeError, OSError):
        return (os.cpu_count() or 1) > 1


@contextmanager
def copies_for(
    folder: Path | None, raw: dict[str, Any] | None, trust_remote_code: bool
) -> Iterator[Prefetch | None]:
    """The float32 copies of the half-precision weights a folder's direct load will likely read
    (`early_files`), begun on a second thread where the process may use two cores
    (`worth_it`): None elsewhere, for no files, and where the files cannot be opened (the load
    then says why). Waited for and let go of on the way out (or once `load_folder` is done)."""
    files = early_files(folder, raw, trust_remote_code)
    early = None
    if files is not None and worth_it():
        try:
            early = Prefetch(files)
        except Exception:  # a broken file: the load reports it as it does without this
            early = None
    try:
        yield early
    finally:
        if early is not None:
            early.close()


class Prefetch:
    """float32 copies of the files' bfloat16 and float16 tensors, made on a second thread from
    the moment it is built; `take` waits for them."""

    def __init__(self, files: list[Path]) -> None:
        import torch
        from safetensors import safe_open

        self._handles: list[Any] = []
        self._copies: dict[tuple[Path, str], Any] = {}
        pairs: list[tuple[Any, Any]] = []
        for path in files:
            handle: Any = safe_open(str(path), framework="pt", device="cpu")
            self._handles.append(handle)
            keys = list(handle.keys())
            for key in keys:
                part = handle.get_slice(key)
                if part.get_dtype() not in CONVERTED:
                    continue
                source = part[...]  # the memory-mapped bytes, not read yet
                copy = torch.empty(source.shape, dtype=torch.float32)
                pairs.append((source, copy))
                self._copies[(path, key)] = copy
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(pairs,), name="embedlens-prefetch", daemon=True
        )
        self._thread.start()

    def _run(self, pairs: list[tuple[Any, Any]]) -> None:
        """Copy the pairs, PER_CALL pieces at a time, each piece on this thread alone (a copy is
        bound by the fresh pages it touches: see `_one_thread`)."""
        from embedlens.compat.torch import batched_copy

        # torch's batched copy is private: taken on the releases it was measured on, else each
        # piece is copied by the public `copy_` (the same elementwise conversion, the same bits)
        batched = batched_copy()
        step = PIECE * PER_CALL
        try:
            for source, copy in pairs:
                whole, into = source.reshape(-1), copy.view(-1)
                for start in range(0, whole.numel(), step):
                    if self._stop.is_set():
                        return
                    sources = whole[start : start + step].split(PIECE)
                    copies = into[start : start + step].split(PIECE)
                    if batched is not None:
                        batched(list(copies), list(sources))
                    else:
                        for piece, target in zip(sources, copies, strict=True):
                            target.copy_(piece)
        except BaseException as e:  # the load then reads the tensors itself
            self._error = e

    def take(self, path: Path, key: str, dtype: Any) -> Any | None:
        """The float32 copy of `key` in `path` once it is made (None when the load should read
        it itself: not converted here, another dtype wanted, or the copies failed)."""
        self._thread.join()
        if self._error is not None:
            self._copies.clear()
        import torch

        if dtype != torch.float32:
            return None
        return self._copies.pop((path, key), None)

    def close(self) -> None:
        """Stop copying (after the current call), wait for the thread and let go of every copy
        not taken."""
        self._stop.set()
        self._thread.join()
        self._copies.clear()
        self._handles.clear()
