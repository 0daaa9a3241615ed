"""What transformers raises while it reads a model, said as one embedlens error (`translated`,
and the weights transformers could not convert named), and what it reports after
(`check_loaded`: weights missing, mismatched or left unused, a GGUF model put on disk)."""

from __future__ import annotations

import pickle
import re
import struct
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from embedlens.compat.transformers import fast
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
from embedlens.text import error_line, first_line


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
def translated(source: ModelSource, what: str, *, weights: bool = False) -> Iterator[None]:
    """Turn the exceptions transformers raises into one clear embedlens error; with `weights`,
    the weights it could not convert named (`conversion_errors_named`)."""
    try:
        with conversion_errors_named(source) if weights else nullcontext():
            yield
    except (SourceError, ConfigError, CheckpointError, UsageError):
        raise
    except ImportError as e:
        hidden = e.__context__
        if "protobuf" in str(e) and isinstance(hidden, ValueError):
            # transformers 5.0 names protobuf's error class in an `except` while its own error
            # is handled: without protobuf, that lookup's ImportError hides the error
            raise _value_error(source, what, hidden) from hidden
        if "gguf" in str(e).lower():
            raise MissingDependencyError(
                "reading GGUF files needs the 'gguf' package", hint="pip install gguf"
            ) from e
        if "compressed-tensors" in str(e) or "compressed_tensors" in str(e):
            raise MissingDependencyError(
                "reading a compressed-tensors checkpoint needs the 'compressed-tensors' package",
                hint="pip install 'embedlens[quant]'",
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
        raise _value_error(source, what, e) from e
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


def _value_error(source: ModelSource, what: str, e: ValueError) -> EmbedlensError:
    """What a ValueError of transformers' says: not a causal LM, code it would run, or a
    checkpoint it could not read."""
    text = str(e)
    if "Unrecognized configuration class" in text or "not supported" in text.lower():
        return ConfigError(
            f"'{source.spec}' is not a causal LM that transformers can build ({first_line(text)})"
        )
    if "trust_remote_code" in text:
        return ConfigError(
            f"'{source.spec}' needs code from its repository",
            hint="embedlens never runs a model's own code unless you pass --trust-remote-code",
        )
    return CheckpointError(f"{what} failed: {first_line(text)}")


def _hub_failure(source: ModelSource, e: BaseException) -> EmbedlensError | None:
    """A hub failure behind what transformers raised (it wraps them in OSError), as embedlens
    says it elsewhere."""
    if source.kind != "hub" or source.repo_id is None:
        return None
    from embedlens.io.hub import closed_client, hub_error

    seen: BaseException | None = e
    for _ in range(8):
        if seen is None:
            return None
        module = type(seen).__module__.split(".")[0]
        if module in ("huggingface_hub", "httpx", "httpx2", "httpcore") or closed_client(seen):
            return hub_error(seen, source.repo_id, "", source.revision)
        seen = seen.__cause__ or seen.__context__
    return None


def check_loaded(source: ModelSource, model: Any, info: dict[str, Any]) -> list[str]:
    """What the load left to check: a GGUF model put partly on disk (`refuse_gguf_on_disk`), the
    loading info (`check_loading_info`); the notes on tensors the model does not use."""
    refuse_gguf_on_disk(source, model)
    return check_loading_info(source, model, info)


def refuse_gguf_on_disk(source: ModelSource, model: Any) -> None:
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
def conversion_errors_named(source: ModelSource) -> Iterator[None]:
    """When transformers stops on weights it could not convert, name them (it points to a report
    it logs, and embedlens keeps transformers' logs quiet)."""
    from transformers import modeling_utils

    if not fast():  # the report's function is private: its pointer to the report is dropped
        try:
            yield
        except RuntimeError as e:
            if "entries of the above report" not in str(e):
                raise
            raise CheckpointError(
                f"'{source.spec}': transformers could not convert some of the checkpoint's "
                "weights, and on this path does not tell embedlens which",
                hint="compare the checkpoint's tensor shapes with its config; where embedlens' "
                "loading shortcuts are taken, the error names them",
            ) from e
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
