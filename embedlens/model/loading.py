"""The one place that hands a model to transformers: configs, meta builds, full loads, tokenizers.

Everything here imports torch and transformers inside its functions, so importing this module is
free. Errors from transformers are translated into embedlens errors at this boundary.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import pickle
import re
import struct
import tempfile
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from embedlens.compat.transformers import direct, fast, import_scan
from embedlens.compat.transformers.gguf_patches import gguf_reads_shared
from embedlens.errors import (
    CheckpointError,
    ConfigError,
    EmbedlensError,
    MissingDependencyError,
    SourceError,
    UnsupportedError,
    UsageError,
)
from embedlens.io.source import ModelSource
from embedlens.model import preflight
from embedlens.text import error_line, first_line

if TYPE_CHECKING:
    from embedlens.model.prefetch import Prefetch

DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda", "mps")

YOUNG_OBJECTS = 10_000
"""Python's youngest generation while loading (its default: 700); see `_fewer_collections`."""
OLDER_COLLECTIONS = 1_000_000
"""Young collections before a collection of the middle generation while loading (default: 10)."""

P = ParamSpec("P")
R = TypeVar("R")


def _fewer_collections(func: Callable[P, R]) -> Callable[P, R]:
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


def _no_collections(func: Callable[P, R]) -> Callable[P, R]:
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


def _quiet_transformers() -> None:
    """transformers imported (its model table scanned once: `import_scan`), its warnings and
    progress bars off."""
    import_scan.scan_once()
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()
    # accelerate warns through plain logging that offloaded weights sit on the meta device
    import logging as stdlib_logging

    stdlib_logging.getLogger("accelerate").setLevel(stdlib_logging.ERROR)


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


def _newer_release_hint(source: ModelSource) -> str | None:
    """For a GGUF file read by a transformers older than the newest CI runs: that release, which
    builds GGUF tokenizers without sentencepiece (older ones convert some through it)."""
    from embedlens.compat import release_text
    from embedlens.compat.transformers import NEWEST_TESTED, installed_transformers, release_key

    found = installed_transformers()
    if not source.is_gguf or found is None or release_key(found) >= release_key(NEWEST_TESTED):
        return None
    return (
        f"or a transformers that builds GGUF tokenizers without it (transformers "
        f"{release_text('transformers')} is installed): pip install 'transformers>={NEWEST_TESTED}'"
    )


@contextmanager
def _translated(source: ModelSource, what: str):  # type: ignore[no-untyped-def]
    """Turn the exceptions transformers raises into one clear embedlens error."""
    try:
        yield
    except (SourceError, ConfigError, CheckpointError, UsageError):
        raise
    except ImportError as e:
        if "gguf" in str(e).lower():
            raise MissingDependencyError(
                "reading GGUF files needs the 'gguf' package", hint="pip install gguf"
            ) from e
        raise MissingDependencyError(
            f"{what} needs a missing package: {e}", hint=_newer_release_hint(source)
        ) from e
    except MemoryError as e:
        from embedlens.errors import ResourceError

        raise ResourceError(
            f"out of memory while {what}",
            hint="try --dtype bfloat16, --device-map auto, or --meta-only",
        ) from e
    except ValueError as e:
        text = str(e)
        if "Unrecognized configuration class" in text or "not supported" in text.lower():
            raise ConfigError(
                f"'{source.spec}' is not a causal LM that transformers can build ({first_line(text)})"
            ) from e
        if "trust_remote_code" in text:
            raise ConfigError(
                f"'{source.spec}' needs code from its repository",
                hint="embedlens never runs a model's own code unless you pass --trust-remote-code",
            ) from e
        raise CheckpointError(f"{what} failed: {first_line(text)}") from e
    except pickle.UnpicklingError as e:
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        raise CheckpointError(
            f"'{source.spec}' holds more than weights: the weights-only loader refused its "
            f"pickle ({'it calls ' + refused.group(1) if refused else first_line(str(e))})",
            hint="embedlens never runs code from a checkpoint; use a safetensors copy of the model",
        ) from e
    except Exception as e:
        hub = _hub_failure(source, e)
        if hub is not None:
            raise hub from e
        if not isinstance(e, (OSError, RuntimeError, KeyError, TypeError, struct.error)) and (
            type(e).__module__.split(".")[0] != "safetensors"
        ):
            raise
        raise CheckpointError(f"{what} failed: {error_line(e, limit=None)}") from e


def _hub_failure(source: ModelSource, e: BaseException) -> EmbedlensError | None:
    """A hub failure behind what transformers raised (it wraps them in OSError), as embedlens
    says it elsewhere."""
    if source.kind != "hub" or source.repo_id is None:
        return None
    from embedlens.io.hub import hub_error

    seen: BaseException | None = e
    for _ in range(8):
        if seen is None:
            return None
        module = type(seen).__module__.split(".")[0]
        if module in ("huggingface_hub", "httpx", "httpx2", "httpcore"):
            return hub_error(seen, source.repo_id, "", source.revision)
        seen = seen.__cause__ or seen.__context__
    return None


_PASSED: dict[int, set[bool]] = {}
"""The trust_remote_code values check_source passed with, by id() of the source checked (an
entry goes with its source, so an id used again starts unchecked)."""


def _passed(source: ModelSource) -> set[bool]:
    """The trust_remote_code values check_source passed `source` with."""
    key = id(source)
    passed = _PASSED.get(key)
    if passed is None:
        passed = _PASSED[key] = set()
        weakref.finalize(source, _PASSED.pop, key, None)
    return passed


def check_source(source: ModelSource, *, trust_remote_code: bool = False) -> None:
    """Read the config and every checkpoint header with embedlens' own checks (once per source)
    before transformers reads the model: a corrupt file, an encoder-only config or one that needs
    remote code ends in embedlens' error, not in transformers' (or in a crash)."""
    if trust_remote_code in _passed(source):
        return
    from embedlens.io.checkpoint import open_checkpoint
    from embedlens.model.headers import (
        check_integer_weights,
        check_matches,
        check_tables,
        read_config,
    )

    ckpt = open_checkpoint(source)
    config = read_config(source, ckpt, trust_remote_code=trust_remote_code)
    if ckpt is not None:
        check_tables(ckpt, config)
        check_matches(source, config, ckpt)
        check_integer_weights(ckpt, config)
    _passed(source).add(trust_remote_code)


@_fewer_collections
def hf_config(source: ModelSource, *, trust_remote_code: bool = False) -> Any:
    """The transformers config object (class defaults applied): for a folder, from the config
    class its model type names (`direct.read_config`), else through AutoConfig."""
    _quiet_transformers()
    with _where(source) as (where, kwargs):
        if source.kind == "hub":
            assert source.path is not None
            where, kwargs = str(source.path), {}
        with _translated(source, "reading the config"), gguf_reads_shared(source):
            config = None if source.is_gguf else direct.read_config(Path(where))
            if config is None:
                from transformers import AutoConfig

                config = AutoConfig.from_pretrained(
                    where, trust_remote_code=trust_remote_code, **kwargs
                )
    check_rope(source, config)
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


@_no_collections
def build_meta_model(source: ModelSource, *, trust_remote_code: bool = False) -> Any:
    """Build the model from its config on the meta device: no weights read, no memory used."""
    config = hf_config(source, trust_remote_code=trust_remote_code)
    import torch

    with _translated(source, "building the model from its config"):
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


@_fewer_collections
def load_model(
    source: ModelSource,
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
    """Load the causal LM with its weights, in eval mode.

    `config`, a transformers config already read from the same source, saves reading it again.
    A weight the checkpoint lacks or holds in another shape is an error (transformers would fill
    it with random values); tensors the model does not use are appended to `notes`. A folder's
    float32 model loaded whole on one device has its weights assigned directly
    (`direct.load_float32`: the same model, without transformers' per-tensor machinery).
    """
    check_source(source, trust_remote_code=trust_remote_code)
    _quiet_transformers()
    options = _load_options(dtype, config, device_map, max_memory, offload_folder)
    preflight.check_load(source, dtype=dtype, device=None if device_map else resolve_device(device))
    direct_ok = dtype == "float32" and not device_map
    with (
        _prefetched(source, trust_remote_code, direct_ok) as early,
        _where(source) as (where, kwargs),
        _translated(source, "loading the model"),
        gguf_reads_shared(source),
        _conversion_errors_named(source),
    ):
        loaded: Any = _load_direct(source, options, trust_remote_code, early) if direct_ok else None
        if early is not None:
            early.close()  # the copies not taken let go (all of them, before from_pretrained)
        if loaded is None:
            from transformers import AutoModelForCausalLM

            # Mismatched shapes come back in the loading info (and are refused below) instead of
            # stopping transformers with a pointer to a report it does not show.
            loaded = AutoModelForCausalLM.from_pretrained(
                where,
                trust_remote_code=trust_remote_code,
                use_safetensors=None,
                output_loading_info=True,
                ignore_mismatched_sizes=True,
                **kwargs,
                **options,
            )
        model, info = loaded
    _refuse_gguf_on_disk(source, model)
    extra = check_loading_info(source, model, info)
    if notes is not None:
        notes.extend(extra)
    if device_map is None:
        model.to(resolve_device(device))
    model.eval()  # autograd is left as the caller has it: the lens runs under inference_mode
    return model


def _load_options(
    dtype: str,
    config: Any,
    device_map: str | None,
    max_memory: dict[Any, int | str] | None,
    offload_folder: str | None,
) -> dict[str, Any]:
    """from_pretrained's keyword arguments for these loading options."""
    options: dict[str, Any] = {"dtype": torch_dtype(dtype)}
    if config is not None:
        options["config"] = config
    if device_map is not None:
        options["device_map"] = device_map
        if max_memory is not None:
            options["max_memory"] = max_memory
        if offload_folder is not None:
            options["offload_folder"] = offload_folder
    return options


def _load_direct(
    source: ModelSource, options: dict[str, Any], trust_remote_code: bool, early: Prefetch | None
) -> tuple[Any, Any] | None:
    """(model, loading info) of a folder's safetensors loaded directly, or None where
    transformers' from_pretrained is needed (see `direct.load_float32`); `early`: the copies
    `_prefetched` began."""
    if source.kind != "dir" or source.path is None:
        return None
    config = options.get("config")
    if config is None:
        config = hf_config(source, trust_remote_code=trust_remote_code)
    files = direct.weight_files(source.path, config)
    return None if files is None else direct.load_float32(source.path, config, files, early)


@contextmanager
def _prefetched(
    source: ModelSource, trust_remote_code: bool, direct_ok: bool
) -> Iterator[Prefetch | None]:
    """The float32 copies of a folder's half-precision weights, begun on a second thread
    (`prefetch.Prefetch`) where the load is likely direct and the process may use two cores:
    None elsewhere, and where the files cannot be opened (the load then says why). Waited for
    and let go of on the way out."""
    files = direct.early_files(source.path, trust_remote_code) if direct_ok else None
    early = None
    if files is not None and source.kind == "dir":
        from embedlens.model import prefetch

        try:
            early = prefetch.Prefetch(files) if prefetch.worth_it() else None
        except Exception:  # a broken file: the load reports it as it does without this
            early = None
    try:
        yield early
    finally:
        if early is not None:
            early.close()


def _refuse_gguf_on_disk(source: ModelSource, model: Any) -> None:
    """A GGUF model that --device-map put partly on disk cannot run (accelerate's offload index
    lacks the weights transformers converted from GGUF): UnsupportedError, before any forward."""
    device_map = getattr(model, "hf_device_map", None) or {}
    on_disk = sorted(name for name, where in device_map.items() if where == "disk")
    if source.is_gguf and on_disk:
        if on_disk == [""]:
            what = "the whole model"
        else:
            what = f"{len(on_disk)} of its modules ({', '.join(on_disk[:SHOWN_KEYS])}"
            what += ", ...)" if len(on_disk) > SHOWN_KEYS else ")"
        raise UnsupportedError(
            f"'{source.path}': --device-map auto puts {what} on disk, and a GGUF model "
            "offloaded to disk cannot run",
            hint="give --max-memory room for the whole model on GPUs and CPU, or load without "
            "--device-map",
        )


SHOWN_KEYS = 3
"""Tensor names a loading error or note lists before saying how many there are in all."""


def _natural(name: str) -> tuple[Any, ...]:
    """Sort key: layers.2 before layers.10."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def _some(names: list[str]) -> str:
    """The first few names, and how many more."""
    shown = ", ".join(names[:SHOWN_KEYS])
    rest = len(names) - SHOWN_KEYS
    return shown + (f" and {rest} more" if rest > 0 else "")


def _shape(shape: Any) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def _older_release_hint(hint: str) -> str:
    """`hint`, and on a transformers older than the newest CI runs, that release (a checkpoint
    a newer transformers wrote may be laid out as older releases do not read it)."""
    from embedlens.compat.transformers import NEWEST_TESTED, installed_transformers, release_key

    found = installed_transformers()
    if found is None or release_key(found) >= release_key(NEWEST_TESTED):
        return hint
    return (
        f"{hint}; or transformers {found} reads this checkpoint's layout otherwise than newer "
        f"releases: pip install 'transformers>={NEWEST_TESTED}'"
    )


def check_loading_info(source: ModelSource, model: Any, info: dict[str, Any]) -> list[str]:
    """Refuse a model that transformers completed with random values; return notes on tensors
    the checkpoint holds that the model does not use.

    Missing weights that are legitimately absent (a head tied to the embedding, keys the model
    class says to ignore) are already left out by transformers; buffers the model computes (rotary
    frequencies, position ids) are not weights and pass too.
    """
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    missing = sorted((k for k in info.get("missing_keys", ()) if k in params), key=_natural)
    mismatched = sorted(info.get("mismatched_keys", ()), key=lambda m: _natural(m[0]))
    if mismatched:
        name, stored, expected = mismatched[0]
        more = f" ({len(mismatched)} tensors in all: {_some([m[0] for m in mismatched])})"
        raise CheckpointError(
            f"'{source.spec}' does not fit its config: {name} is {_shape(stored)} in the "
            f"checkpoint but {_shape(expected)} in the model the config describes"
            + (more if len(mismatched) > 1 else ""),
            hint=_older_release_hint(
                "the config and the weights come from different models, or one was edited"
            ),
        )
    if missing:
        raise CheckpointError(
            f"'{source.spec}' lacks {len(missing)} of the model's weights ({_some(missing)}): "
            "transformers would fill the gap with random values",
            hint=_older_release_hint(
                "the checkpoint is incomplete, or its config describes a larger model"
            ),
        )
    unexpected = sorted(info.get("unexpected_keys", ()), key=_natural)
    if not unexpected:
        return []
    return [
        f"the checkpoint holds {len(unexpected)} tensor{'s' * (len(unexpected) > 1)} the model "
        "does not use "
        f"({_some(unexpected)}); they were left out"
    ]


@contextmanager
def _conversion_errors_named(source: ModelSource) -> Iterator[None]:
    """When transformers stops on weights it could not convert, name them (it points to a report
    it logs, and embedlens keeps transformers' logs quiet)."""
    from transformers import modeling_utils

    if not fast():  # the report's function is private: transformers' own error stands
        yield
        return
    original = modeling_utils.log_state_dict_report
    seen: list[Any] = []

    def capture(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("loading_info"))
        return original(*args, **kwargs)

    modeling_utils.log_state_dict_report = capture
    try:
        yield
    except RuntimeError as e:
        errors = getattr(seen[-1], "conversion_errors", None) if seen else None
        if not errors:
            raise
        names = sorted(errors, key=_natural)
        raise CheckpointError(
            f"'{source.spec}': transformers could not convert {len(names)} of the checkpoint's "
            f"weights ({_some(names)}): {_exception_line(errors[names[0]])}"
        ) from e
    finally:
        modeling_utils.log_state_dict_report = original


def _exception_line(text: str) -> str:
    """The exception's own line in a traceback transformers kept as text."""
    lines = [line for line in text.splitlines() if re.match(r"^[\w.]+(Error|Exception): ", line)]
    return lines[-1] if lines else first_line(text)


@_fewer_collections
def load_tokenizer(source: ModelSource, *, trust_remote_code: bool = False) -> Any:
    """The model's tokenizer: a folder's tokenizer.json through the `tokenizers` library where
    transformers would read it into its generic class unchanged (`direct_tokenizer`), else
    through transformers (GGUF: rebuilt from the file's metadata)."""
    check_source(source, trust_remote_code=trust_remote_code)
    _quiet_transformers()
    fast = _direct_tokenizer(source, trust_remote_code=trust_remote_code)
    if fast is not None:
        return fast  # tokenizer.json checked by `tokenizers` and `direct_tokenizer`
    check_tokenizer_files(source)
    from transformers import AutoTokenizer

    try:
        with (
            _where(source) as (where, kwargs),
            _translated(source, "loading the tokenizer"),
            gguf_reads_shared(source),
        ):
            return AutoTokenizer.from_pretrained(
                where, trust_remote_code=trust_remote_code, **kwargs
            )
    except CheckpointError as e:
        if "Couldn't instantiate the backend tokenizer" not in e.message:
            raise
        raise UnsupportedError(
            f"'{source.spec}' has no tokenizer.json, and transformers cannot build its tokenizer "
            "from the files it has",
            hint="save a fast tokenizer (tokenizer.json) beside the model, or install "
            "sentencepiece (or tiktoken) for a slow one",
        ) from e


def _direct_tokenizer(source: ModelSource, *, trust_remote_code: bool) -> Any:
    """A folder's tokenizer read directly, or None (then transformers reads it)."""
    from embedlens.compat.transformers.direct_tokenizer import open_tokenizer

    folder = source.path
    if source.kind != "dir" or folder is None:
        return None
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or (trust_remote_code and "auto_map" in config):
        return None
    return open_tokenizer(folder, config)


def check_tokenizer_files(source: ModelSource) -> None:
    """embedlens' own checks of the tokenizer before transformers reads it: a GGUF file's
    tokenizer arrays, a tokenizer.json's top-level keys."""
    from embedlens.model.tokenizer import check_tokenizer_json

    if source.is_gguf:
        from embedlens.model.file_tokens import file_vocab

        assert source.path is not None
        file_vocab(source.path)  # kept: the prompt's ids are checked against it (file_tokens)
        return
    path = source.find("tokenizer.json")
    if path is not None:
        check_tokenizer_json(path)
