"""The one place that hands a model to transformers: configs, meta builds, full loads, tokenizers.

Each takes the source's files as read once (`files.ModelFiles`: headers and config, checked by
embedlens before transformers reads them). Everything here imports torch and transformers inside
its functions, so importing this module is free; errors from transformers are translated into
embedlens errors at this boundary (`reading`, `load_errors`). Python's cyclic garbage collector
is held back while a load runs (`fewer_collections`, `no_collections`): the objects it makes live
as long as the process.
"""

from __future__ import annotations

import functools
import gc
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from embedlens.compat.transformers import direct, import_scan
from embedlens.compat.transformers.gguf_patches import gguf_reads_shared
from embedlens.errors import (
    CheckpointError,
    ConfigError,
    SourceError,
    UnsupportedError,
    UsageError,
)
from embedlens.io.source import ModelSource
from embedlens.model import gguf_cache, preflight
from embedlens.model.files import ModelFiles, check_source
from embedlens.model.load_errors import check_loaded, conversion_errors_named, translated

DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")

DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda", "mps")


# --- Python's garbage collector held back while transformers is imported and a model built ---

YOUNG_OBJECTS = 10_000
"""Python's youngest generation while loading (its default: 700); see `fewer_collections`."""

OLDER_COLLECTIONS = 1_000_000
"""Young collections before a collection of the middle generation while loading (default: 10)."""

P = ParamSpec("P")

R = TypeVar("R")


def fewer_collections(func: Callable[P, R]) -> Callable[P, R]:
    """`func` with Python's cyclic garbage collector run less often: importing torch and
    transformers and building a model make some 380,000 objects that live as long as the
    process. With the default thresholds the collector went through the growing heap whole 6
    times while a Llama's class was imported (0.66 s of 0.82 s collecting, out of 4.5 s); with
    10,000 young objects before a collection, every object was still gone through twice, young
    and again in the middle generation (0.3 and 0.45 CPU seconds of a DeepSeek-V3 `--meta-only`
    count at load 4 to 6). While loading, only the young generation is collected (garbage is
    still collected, nothing computed depends on when), and what survives goes to the oldest
    generation after, not through the middle one again (`_survivors_to_oldest`): garbage that
    outlived a young collection waits for the oldest generation's next collection. The
    thresholds are set back after (never changed where automatic collection is off)."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        before = gc.get_threshold()
        if before[0] <= 0:
            return func(*args, **kwargs)
        gc.set_threshold(
            max(before[0], YOUNG_OBJECTS), max(before[1], OLDER_COLLECTIONS), before[2]
        )
        try:
            return func(*args, **kwargs)
        finally:
            gc.set_threshold(*before)
            _survivors_to_oldest()

    return wrapper


def no_collections(func: Callable[P, R]) -> Callable[P, R]:
    """`func` with no automatic collection: for a build on the meta device, whose tensors hold no
    memory for garbage to keep. Every object left after goes to the oldest generation
    (`_survivors_to_oldest`), the garbage of the imports with it, collected with that
    generation; collection is on again after where it was on before."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        was_on = gc.isenabled()
        gc.disable()
        try:
            return func(*args, **kwargs)
        finally:
            if was_on:
                gc.enable()
            _survivors_to_oldest()

    return wrapper


def _survivors_to_oldest() -> None:
    """Move every object the collector tracks to its oldest generation, as `gc.freeze()` then
    `gc.unfreeze()` do (two list splices: nothing is gone through). The oldest generation is
    collected whole when enough has survived there since its last collection; left in the
    middle one, the load's 380,000 objects would all be gone through at the next collection of
    it, soon after the load. Skipped when the caller has frozen objects of its own (unfreezing
    would hand them back to the collector)."""
    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()


def reads_files(
    func: Callable[Concatenate[ModelFiles, P], R],
) -> Callable[Concatenate[ModelSource | ModelFiles, P], R]:
    """`func` given its source's files as read once (`check_source`: a source is read and checked by
    embedlens here, before transformers is imported), then transformers imported quietly
    (`import_scan.quiet`): what a load of the model or its tokenizer does first."""

    @functools.wraps(func)
    def wrapper(source: ModelSource | ModelFiles, /, *args: P.args, **kwargs: P.kwargs) -> R:
        trust = bool(kwargs.get("trust_remote_code"))
        files = (
            source
            if isinstance(source, ModelFiles)
            else check_source(source, trust_remote_code=trust)
        )
        import_scan.quiet()
        return func(files, *args, **kwargs)

    return wrapper


@contextmanager
def reading(source: ModelSource, what: str, *, weights: bool = False) -> Iterator[None]:
    """While transformers reads `source` (`what`, for messages): its errors `translated` (with
    `weights`, the weights it could not convert named), a GGUF file parsed once however often it
    is read (`gguf_reads_shared`)."""
    with translated(source, what, weights=weights), gguf_reads_shared(source):
        yield


@contextmanager
def _where(source: ModelSource) -> Iterator[tuple[str, dict[str, Any]]]:
    """What to pass to from_pretrained: a local folder, or a repo id and revision."""
    if source.kind == "gguf":
        assert source.path is not None
        # An absolute gguf_file: from_pretrained tries gguf_file relative to the working
        # directory first, so a bare name would load a same-named file from there instead.
        path = source.whole_gguf().resolve()
        with _gguf_named(path) as named:
            yield str(path.parent), {"gguf_file": str(named)}
        return
    if source.kind == "hub":
        assert source.repo_id is not None
        yield source.repo_id, {"revision": source.revision}
        return
    yield str(source.path), {}


@contextmanager
def _gguf_named(path: Path) -> Iterator[Path]:
    """The GGUF file under a name ending in .gguf: transformers tells a GGUF checkpoint by that
    suffix. A file named otherwise (a download saved as model.bin, a hub cache blob) is linked
    from a temporary folder, removed afterwards; the file itself is left as it is."""
    if path.suffix.lower() == ".gguf":
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="embedlens-gguf-") as folder:
        named = Path(folder) / f"{path.name}.gguf"
        try:
            named.symlink_to(path)
        except OSError as e:
            raise SourceError(
                f"cannot link '{path}' under a .gguf name for transformers: {e.strerror or e}",
                hint="copy or rename the file to a name ending in .gguf",
            ) from e
        yield named


@fewer_collections
def hf_config(source: ModelSource, *, trust_remote_code: bool = False) -> Any:
    """The transformers config object (class defaults applied): for a folder, from the config
    class its model type names (`direct.read_config`), else through AutoConfig; a GGUF file's
    as kept from an earlier run (`gguf_cache`) where it reads back the same."""
    import_scan.quiet()
    return _config(source, trust_remote_code)


@fewer_collections
@reads_files
def tokenizer_and_config(
    files: ModelFiles, tokenizer: Any = None, *, trust_remote_code: bool = False
) -> tuple[Any, Any]:
    """The model's tokenizer (`load_tokenizer`; the one given, if any) and its config
    (`hf_config`), transformers imported once for both."""
    if tokenizer is None:
        tokenizer = _tokenizer(files, trust_remote_code)
    return tokenizer, _config(files.source, trust_remote_code)


def _config(source: ModelSource, trust_remote_code: bool) -> Any:
    """`hf_config` once transformers is imported."""
    config = _kept(source, "config.json", trust_remote_code)
    check_rope(source, config)
    return config


def _kept(source: ModelSource, name: str, trust_remote_code: bool) -> Any:
    """`_built` of `source` for `name`, as kept of a GGUF file (`gguf_cache.kept`: then named as
    transformers names what it read from the file); a hub model's config read from its folder."""
    with _where(source) as (where, kwargs):
        if name == "config.json" and source.kind == "hub":
            assert source.path is not None
            where, kwargs = str(source.path), {}
        if not source.is_gguf:  # the cache keeps what transformers reads of a GGUF file alone
            return _built(source, name, where, kwargs, trust_remote_code)
        build = functools.partial(_built, source, name, where, kwargs, trust_remote_code)
        built, kept = gguf_cache.kept(source, name, build)
        if kept:
            built.name_or_path = where
    return built


def _built(
    source: ModelSource, name: str, where: str, kwargs: dict[str, Any], trust_remote_code: bool
) -> Any:
    """What transformers builds of `source` (from `where`, with `kwargs`) for `name`: its config
    ('config.json': for a folder from the class its model type names, `direct.read_config`, else
    through AutoConfig) or its tokenizer ('tokenizer.json', through AutoTokenizer)."""
    what = "reading the config" if name == "config.json" else "loading the tokenizer"
    with reading(source, what):
        if name == "tokenizer.json":
            return _from_pretrained("AutoTokenizer", where, trust_remote_code, kwargs)
        config = None if source.is_gguf else direct.read_config(Path(where))
        if config is None:
            config = _from_pretrained("AutoConfig", where, trust_remote_code, kwargs)
        return config


def check_rope(source: ModelSource, config: Any) -> None:
    """ConfigError for a rope type transformers has no implementation of (it would end in a
    bare KeyError while the model is built)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return
    # One dict, or one per attention type (Gemma 3: full_attention, sliding_attention).
    groups = [params, *(v for v in params.values() if isinstance(v, dict))]
    for group in groups:
        kind = group.get("rope_type", group.get("type"))
        if kind is not None and kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
            where = f"'{source.spec}'" if source.is_gguf else f"config.json of '{source.spec}'"
            known = ", ".join(["default", *ROPE_INIT_FUNCTIONS])
            raise ConfigError(
                f"{where} asks for rope type {kind!r}, which transformers does not know "
                f"(it knows {known})"
            )


@no_collections
def build_meta_model(source: ModelSource, *, trust_remote_code: bool = False) -> Any:
    """Build the model from its config on the meta device: no weights read, no memory used."""
    config = hf_config(source, trust_remote_code=trust_remote_code)
    import torch

    with translated(source, "building the model from its config"):
        built = direct.build_on_meta(config)
        if built is None:
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                built = AutoModelForCausalLM.from_config(
                    config, trust_remote_code=trust_remote_code
                )
        # tied as from_pretrained ties them: transformers before 5.24 builds a config's tied
        # head as a matrix of its own on the meta device
        built.tie_weights()
        return built


def check_device(device: str) -> None:
    """A device name embedlens knows (cpu, cuda, cuda:N, mps, auto); checked before any work."""
    if device not in DEVICES and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise UsageError(f"unknown device '{device}'", hint="use one of: " + ", ".join(DEVICES))


def check_dtype(name: str) -> None:
    """A dtype name embedlens knows (auto, float32, bfloat16, float16)."""
    if name not in DTYPES:
        raise UsageError(f"unknown dtype '{name}'", hint="use one of: " + ", ".join(DTYPES))


def check_choices(dtype: str, device: str) -> None:
    """A dtype and a device embedlens knows (`check_dtype`, `check_device`), the dtype first."""
    check_dtype(dtype)
    check_device(device)


def resolve_device(device: str) -> str:
    """'auto' becomes cuda, mps or cpu, whichever is there; others are checked."""
    import torch

    check_device(device)
    if device.startswith("cuda:") and device[5:].isdigit():
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if int(device[5:]) >= count:
            raise UsageError(
                f"--device {device} was asked for, but this machine has {count} CUDA devices"
            )
        return device
    if device == "auto":
        if torch.cuda.is_available():
            return "cuda"
        mps = getattr(torch.backends, "mps", None)
        return "mps" if mps is not None and mps.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for, but no CUDA device is available")
    if device == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise UsageError("--device mps was asked for, but MPS is not available")
    return device


def torch_dtype(name: str) -> Any:
    """A dtype name as torch's dtype ('auto' stays 'auto')."""
    check_dtype(name)
    if name == "auto":
        return "auto"
    import torch

    return getattr(torch, name)


@fewer_collections
@reads_files
def load_model(
    files: ModelFiles,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    device_map: str | None = None,
    max_memory: dict[Any, int | str] | None = None,
    offload_folder: str | None = None,
    trust_remote_code: bool = False,
    config: Any = None,
    notes: list[str] | None = None,
) -> Any:
    """Load the causal LM with its weights, in eval mode, from its files (given a source as
    resolved, or its files as read already by `check_source`: `reads_files`).

    `config`, a transformers config already read from the same source, saves reading it again.
    A weight the checkpoint lacks or holds in another shape is an error (transformers would fill
    it with random values); tensors the model does not use are appended to `notes`. A folder's
    float32 model loaded whole on one device has its weights assigned directly
    (`direct.load_folder`: the same model, without transformers' per-tensor machinery), its
    half-precision tensors copied to float32 on a second thread meanwhile (`direct.copies_for`).
    """
    source = files.source
    options = _load_options(dtype, config, device_map, max_memory, offload_folder)
    preflight.check_load(files, dtype=dtype, device=None if device_map else resolve_device(device))
    folder = source.path if dtype == "float32" and not device_map and source.kind == "dir" else None
    with (
        direct.copies_for(folder, files.config_json, trust_remote_code) as early,
        _where(source) as (where, kwargs),
        reading(source, "loading the model", weights=folder is None),
    ):
        loaded: Any = None
        if folder is not None:
            if config is None:
                config = hf_config(source, trust_remote_code=trust_remote_code)
            loaded = direct.load_folder(folder, config, early)  # the copies not taken let go
        if loaded is None:  # the weights transformers could not convert named (the direct load
            # converts none: it leaves a checkpoint to convert to from_pretrained)
            named = nullcontext() if folder is None else conversion_errors_named(source)
            with named:
                loaded = _from_pretrained(
                    "AutoModelForCausalLM", where, trust_remote_code, {**kwargs, **options}
                )
        model, info = loaded
    extra = check_loaded(source, model, info)
    if notes is not None:
        notes.extend(extra)
    if device_map is None:
        model.to(resolve_device(device))
    model.eval()  # autograd is left as the caller has it: the lens runs under inference_mode
    return model


def _from_pretrained(
    auto: str, where: str, trust_remote_code: bool, options: dict[str, Any]
) -> Any:
    """What transformers' `auto` class (AutoConfig, AutoTokenizer, AutoModelForCausalLM) reads
    from `where` (`from_pretrained`, with these keyword arguments): the one call into it of
    every read of a source's config, tokenizer or model."""
    import transformers

    return getattr(transformers, auto).from_pretrained(
        where, trust_remote_code=trust_remote_code, **options
    )


def _load_options(
    dtype: str,
    config: Any,
    device_map: str | None,
    max_memory: dict[Any, int | str] | None,
    offload_folder: str | None,
) -> dict[str, Any]:
    """from_pretrained's keyword arguments for these loading options. Mismatched shapes come
    back in the loading info (and are refused by `check_loaded`) instead of stopping
    transformers with a pointer to a report it does not show."""
    options: dict[str, Any] = {
        "use_safetensors": None,
        "output_loading_info": True,
        "ignore_mismatched_sizes": True,
        "dtype": torch_dtype(dtype),
    }
    if config is not None:
        options["config"] = config
    if device_map is not None:
        options["device_map"] = device_map
        if max_memory is not None:
            options["max_memory"] = max_memory
        if offload_folder is not None:
            options["offload_folder"] = offload_folder
    return options


@fewer_collections
@reads_files
def load_tokenizer(files: ModelFiles, *, trust_remote_code: bool = False) -> Any:
    """The model's tokenizer (given a source, or its files as read already: `reads_files`): a
    folder's tokenizer.json through the `tokenizers` library where transformers would read it
    into its generic class unchanged (`direct_tokenizer`), else through transformers (GGUF:
    rebuilt from the file's metadata)."""
    return _tokenizer(files, trust_remote_code)


def _tokenizer(files: ModelFiles, trust_remote_code: bool) -> Any:
    """`load_tokenizer` once transformers is imported."""
    fast = _direct_tokenizer(files, trust_remote_code=trust_remote_code)
    if fast is not None:
        return fast  # tokenizer.json checked by `tokenizers` and `direct_tokenizer`
    check_tokenizer_files(files)
    try:
        return _kept(files.source, "tokenizer.json", trust_remote_code)
    except CheckpointError as e:
        if "Couldn't instantiate the backend tokenizer" not in e.message:
            raise
        raise UnsupportedError(
            f"'{files.source.spec}' has no tokenizer.json, and transformers cannot build its "
            "tokenizer from the files it has",
            hint="save a fast tokenizer (tokenizer.json) beside the model, or install "
            "sentencepiece (or tiktoken) for a slow one",
        ) from e


def _direct_tokenizer(files: ModelFiles, *, trust_remote_code: bool) -> Any:
    """A folder's tokenizer read directly, or None (then transformers reads it)."""
    from embedlens.compat.transformers.direct_tokenizer import open_tokenizer

    folder, config = files.source.path, files.config_json
    if files.source.kind != "dir" or folder is None or config is None:
        return None
    if trust_remote_code and "auto_map" in config:
        return None
    return open_tokenizer(folder, config)


def check_tokenizer_files(files: ModelFiles) -> None:
    """embedlens' own checks of the tokenizer before transformers reads it: a GGUF file's
    tokenizer arrays (from the header read already), a tokenizer.json's top-level keys."""
    from embedlens.model.tokenizer import check_tokenizer_json

    source = files.source
    if source.is_gguf:
        from embedlens.model.file_tokens import file_vocab

        assert source.path is not None
        header = None if files.checkpoint is None else files.checkpoint.gguf
        file_vocab(source.path, header)  # kept: the prompt's ids are checked against it
        return
    path = source.find("tokenizer.json")
    if path is not None:
        check_tokenizer_json(path)
