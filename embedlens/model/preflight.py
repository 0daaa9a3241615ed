"""Memory pre-flight: refuse a load that would not fit, before the kernel's OOM killer ends it.

The estimate comes from the checkpoint's headers and the dtype asked for: the weights at that
dtype, plus the largest tensor once more for the copy a conversion makes on the way. Where the
config implies larger matrices or more blocks than are stored (transformers allocates what the
config says before it reads a weight), the larger figure counts. The memory
available is /proc/meminfo's MemAvailable, lowered to the headroom of a cgroup limit when the
process runs under one (containers), or torch.cuda.mem_get_info() for a CUDA device.
EMBEDLENS_MEMORY_LIMIT (bytes, or with a unit: 512MiB, 8GB) overrides what is read, on every
device. Where nothing can be read (no /proc, MPS) the load goes ahead unchecked.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from embedlens.errors import EmbedlensError, ResourceError, UsageError
from embedlens.io.source import ModelSource
from embedlens.text import binary_size

if TYPE_CHECKING:
    from embedlens.io.checkpoint import Checkpoint
    from embedlens.model.files import ModelConfig, ModelFiles

MEMORY_LIMIT_ENV = "EMBEDLENS_MEMORY_LIMIT"
_UNITS = {
    "": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}  # fmt: skip
_FLOAT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
_STORED_FLOATS = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


@dataclass(frozen=True)
class Estimate:
    """What a load is expected to take."""

    weights: int
    """Bytes of all weights at the dtype they will have once loaded."""
    largest: int
    """Bytes of the largest tensor (the copy a conversion makes of one tensor at a time)."""
    dtype: str
    """The dtype the floating-point weights will have ('bfloat16', or 'as stored')."""

    @property
    def needed(self) -> int:
        """Bytes the load is expected to need at its peak."""
        return self.weights + self.largest


def parse_size(text: str) -> int:
    """'8GiB', '512 MB', '1e9' or '123456' as bytes; ValueError otherwise."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if m is None or m.group(2) not in _UNITS:
        raise ValueError(f"not a size: {text!r}")
    value = float(m.group(1)) * _UNITS[m.group(2)]
    if not math.isfinite(value) or value >= 1 << 80:  # 1e400 is no amount of memory
        raise ValueError(f"not a size: {text!r}")
    return int(value)


def meminfo_available(text: str) -> int | None:
    """MemAvailable from the text of /proc/meminfo, in bytes."""
    m = re.search(r"^MemAvailable:\s+(\d+)\s*kB", text, re.MULTILINE)
    return int(m.group(1)) * 1024 if m else None


def cgroup_headroom(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes left under this process's cgroup memory limit (v2, else v1); None without a limit."""
    for limit_file, usage_file in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        try:
            limit = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
            return None
        return max(int(limit) - usage, 0)
    return None


def host_memory_available() -> int | None:
    """Bytes of memory a new allocation may take on this host, or None when it cannot be read."""
    found: int | None = None
    with contextlib.suppress(OSError):
        found = meminfo_available(Path("/proc/meminfo").read_text())
    if found is None:
        try:
            found = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            found = None
    headroom = cgroup_headroom()
    if headroom is not None:
        found = headroom if found is None else min(found, headroom)
    return found


def memory_limit_override() -> int | None:
    """EMBEDLENS_MEMORY_LIMIT in bytes, when set."""
    text = os.environ.get(MEMORY_LIMIT_ENV, "").strip()
    if not text:
        return None
    try:
        return parse_size(text)
    except ValueError:
        raise UsageError(
            f"{MEMORY_LIMIT_ENV}={text!r} is not a size",
            hint=f"give bytes or a size with a unit, e.g. {MEMORY_LIMIT_ENV}=16GiB",
        ) from None


def available(device: str) -> tuple[int | None, str]:
    """Bytes available for weights on a device ('cpu', 'cuda', 'cuda:1', 'mps'), and its name."""
    override = memory_limit_override()
    if device.startswith("cuda"):
        where = "GPU memory" + (f" on {device}" if ":" in device else "")
        if override is not None:
            return override, where
        import torch

        index = int(device.split(":", 1)[1]) if ":" in device else torch.cuda.current_device()
        free, _total = torch.cuda.mem_get_info(index)
        return int(free), where
    if override is not None:
        return override, "memory"
    if device == "mps":  # unified memory: the system's own accounting is not readable here
        return None, "memory"
    return host_memory_available(), "memory"


def estimate(source: ModelSource, dtype: str) -> Estimate | None:
    """The bytes a load at `dtype` takes, from the headers; None when they cannot be read."""
    from embedlens.io.checkpoint import open_checkpoint

    try:
        ckpt = open_checkpoint(source)
    except EmbedlensError:
        return None  # the load itself will say what is wrong
    if ckpt is None or not ckpt.tensors:
        return None
    return _estimate(
        ckpt,
        dtype,
        lambda: _config_dtype(source),
        lambda: _config_beyond_headers(_config_or_none(source, ckpt), ckpt),
    )


def estimate_files(files: ModelFiles, dtype: str) -> Estimate | None:
    """`estimate` from the files as read already (`files.check_source`)."""
    ckpt = files.checkpoint
    if ckpt is None or not ckpt.tensors:
        return None
    raw = files.config_json
    return _estimate(
        ckpt, dtype, lambda: None if raw is None else _raw_dtype(raw), lambda: _as_stored(files)
    )


def _as_stored(files: ModelFiles) -> tuple[int, int]:
    """`_config_beyond_headers` of files `check_source` read: their config's sizes agree with
    the checkpoint's, so nothing is allocated beyond the stored tensors; the embedding's
    elements."""
    assert files.checkpoint is not None
    found = None if files.embedding is None else files.checkpoint.tensors.get(files.embedding)
    if found is None or len(found.shape) != 2:
        return 0, 0
    rows, width = found.shape
    return 0, rows * width


def _estimate(
    ckpt: Checkpoint,
    dtype: str,
    configured_dtype: Callable[[], str | None],
    beyond_headers: Callable[[], tuple[int, int]],
) -> Estimate | None:
    """`estimate` from the headers, with the config's dtype and what the config adds to them
    (`_config_beyond_headers`) found on demand."""
    target = _FLOAT_BYTES.get(dtype)
    label = dtype
    if target is None:  # auto: the config's dtype, else as stored (GGUF: dequantised to float32)
        configured = configured_dtype()
        target = _FLOAT_BYTES.get(configured or "")
        label = (
            configured
            if target and configured
            else "float32"
            if ckpt.format == "gguf"
            else "as stored"
        )
        if target is None and ckpt.format == "gguf":
            target = 4
    weights = largest = 0
    per_element = target or 4
    for t in ckpt.tensors.values():
        if ckpt.format == "gguf":
            size = (
                t.numel * (target or 4) if t.dtype not in ("I8", "I16", "I32", "I64") else t.nbytes
            )
        elif t.dtype in _STORED_FLOATS:
            size = t.numel * (target or _STORED_FLOATS[t.dtype])
        else:
            size = t.nbytes  # integers (packed quantisations) are not converted
        weights += size
        largest = max(largest, size)
    beyond, matrix = beyond_headers()
    weights += beyond * per_element
    largest = max(largest, matrix * per_element)
    return Estimate(weights, largest, label)


def _config_or_none(source: ModelSource, ckpt: Checkpoint) -> ModelConfig | None:
    """The config as `read_config` reads it (without refusing remote code), or None when it
    cannot be read."""
    from embedlens.model.files import read_config

    try:
        return read_config(source, ckpt, trust_remote_code=True)
    except EmbedlensError:
        return None


def _config_beyond_headers(config: ModelConfig | None, ckpt: Checkpoint) -> tuple[int, int]:
    """Elements transformers allocates beyond the stored ones when it builds the model from the
    config (a larger vocabulary, width or block count than the checkpoint stores), and the
    elements of the embedding matrix the config implies; (0, 0) when the config cannot be read.
    """
    from embedlens.model.anatomy import find_tables
    from embedlens.model.files import mismatches

    if config is None:
        return 0, 0
    shapes = {name: t.shape for name, t in ckpt.tensors.items()}
    embedding, head = find_tables(shapes, config.vocab_size)
    if embedding is None or len(shapes[embedding]) != 2:
        return 0, 0
    found = mismatches(config, ckpt, embedding)
    said = {label.split()[0]: figure for label, figure, _ in found}
    rows, width = shapes[embedding]
    implied = said.get("vocabulary", rows) * said.get("width", width)
    matrices = 1 if head is None else 2
    beyond = max(implied - rows * width, 0) * matrices
    if "layers" in said:
        stored = {n: t.numel for n, t in ckpt.tensors.items() if _layer(n) is not None}
        layers = {_layer(n) for n in stored}
        per_block = sum(stored.values()) // max(len(layers), 1)
        beyond += max(said["layers"] - len(layers), 0) * per_block
    return beyond, implied


def _layer(name: str) -> int | None:
    from embedlens.model.anatomy import place

    return place(name, embedding=(), head=()).layer


def _config_dtype(source: ModelSource) -> str | None:
    if source.is_gguf:
        return None
    try:
        path = source.find("config.json")
        raw = json.loads(path.read_text(encoding="utf-8")) if path is not None else {}
    except (OSError, ValueError, EmbedlensError):
        return None
    return _raw_dtype(raw) if isinstance(raw, dict) else None


def _raw_dtype(raw: dict[str, Any]) -> str | None:
    """The dtype config.json names (its text part's, else its own)."""
    for part in (raw.get("text_config"), raw):
        if isinstance(part, dict):
            value = part.get("dtype") or part.get("torch_dtype")
            if isinstance(value, str):
                return value
    return None


def check_load(files: ModelFiles, *, dtype: str, device: str | None) -> Estimate | None:
    """Refuse (ResourceError) a load onto `device` that would not fit; device None: unchecked.

    A CUDA load passes through host memory first (transformers builds the model there, then
    moves it), so both must hold it.
    """
    if device is None:
        return None
    est = estimate_files(files, dtype)
    if est is None:
        return None
    checks = [("cpu", est.needed)]
    if device.startswith("cuda"):
        checks.append((device, est.weights))
    for where, needed in checks:
        free, label = available(where)
        if free is not None and needed > free:
            raise ResourceError(
                f"loading '{files.source.spec}' needs about {binary_size(needed)} of {label} "
                f"({binary_size(est.weights)} of weights at {est.dtype}), but only "
                f"{binary_size(free)} is available",
                hint=_hint(est),
            )
    return est


def _hint(est: Estimate) -> str:
    options = []
    if est.dtype not in ("bfloat16", "float16"):
        options.append("--dtype bfloat16 (half the bytes of float32)")
    options.append("--device-map auto (lens: spread the weights over GPU, CPU and disk)")
    options.append("--meta-only (params, tied: no weights at all)")
    return "try " + ", ".join(options) + f"; {MEMORY_LIMIT_ENV} sets the memory assumed available"
