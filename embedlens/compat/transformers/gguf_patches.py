"""Sharing a GGUF file's parse across transformers' config, tokenizer and weight loading.

transformers' GGUF loader builds a `gguf.GGUFReader` (parsing every metadata field, some 49k-long
token lists) for the config, again for the tokenizer and again for the weights, and rebuilds gguf's
tensor-name table for every submodule. The patches below cache those per context. They replace
module attributes that transformers looks up at call time, so they are applied only when those
functions still have the signatures written here (`patchable()`); otherwise loading runs
unpatched, slower but the same. tests/test_gguf_patches.py fails when transformers or gguf move
them.
"""

from __future__ import annotations

import copy
import inspect
import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from embedlens.compat.transformers import fast
from embedlens.io.source import ModelSource

EXPECTED = {
    "gguf.GGUFReader": ["path", "mode"],
    "gguf.get_tensor_name_map": ["arch", "n_blocks"],
    "gguf.dequantize": ["data", "qtype"],
    "load_gguf_checkpoint": ["gguf_checkpoint_path", "return_tensors"],
}
"""The leading parameters each patched function must have."""

_IMPORTED_AT_CALL = ("from gguf import GGUFReader, dequantize", "get_tensor_name_map")
"""What transformers' loader must look up from gguf when it runs (so a patch is seen)."""


def _leading(fn: Any, n: int) -> list[str]:
    try:
        target = fn.__init__ if inspect.isclass(fn) else fn
        names = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return []
    return names[1 : n + 1] if inspect.isclass(fn) else names[:n]


def patchable() -> bool:
    """Whether gguf and transformers still have what the patches replace, as written here (and
    the gate in `embedlens.compat.transformers` lets them be taken)."""
    if not fast("gguf"):
        return False
    try:
        import gguf
        from transformers import modeling_gguf_pytorch_utils as hf_gguf
    except ImportError:
        return False
    found = {
        "gguf.GGUFReader": getattr(gguf, "GGUFReader", None),
        "gguf.get_tensor_name_map": getattr(gguf, "get_tensor_name_map", None),
        "gguf.dequantize": getattr(gguf, "dequantize", None),
        "load_gguf_checkpoint": getattr(hf_gguf, "load_gguf_checkpoint", None),
    }
    for name, params in EXPECTED.items():
        fn = found[name]
        if fn is None or _leading(fn, len(params)) != params:
            return False
    try:
        source = inspect.getsource(hf_gguf)
    except (OSError, TypeError):
        return False
    return hasattr(hf_gguf, "tqdm") and all(text in source for text in _IMPORTED_AT_CALL)


_shared: dict[str, Any] = {"depth": 0}


@contextmanager
def sharing_gguf_reads() -> Iterator[None]:
    """While open, transformers parses a GGUF file once for its config, tokenizer and weights.

    transformers' GGUF loader builds a `gguf.GGUFReader` (parsing every metadata field, some
    49k-long token lists) for the config, again for the tokenizer and again for the weights, and
    rebuilds gguf's tensor-name table for every submodule of the model. Inside this context the
    reader is kept per file (and parses a plain ndarray view of the file: the same bytes, without
    numpy's per-slice memmap overhead), the name table per (architecture, blocks), and the
    metadata-only parse per file (handed out as deep copies) until the weights are read. While
    the weights are dequantised, the file pages each tensor was read from are released once the
    next tensor starts (they would otherwise stay counted in the process's memory until the end
    of the load). Re-entrant; the caches go when the outermost context closes.
    """
    if _shared["depth"] == 0:
        _shared.update(patches=_install_gguf_caches() if patchable() else [])
    _shared["depth"] += 1
    try:
        yield
    finally:
        _shared["depth"] -= 1
        if _shared["depth"] == 0:
            for owner, name, original in _shared.pop("patches"):
                setattr(owner, name, original)


@contextmanager
def gguf_reads_shared(source: ModelSource) -> Iterator[None]:
    """`sharing_gguf_reads()` for a GGUF source; nothing for any other."""
    if source.kind != "gguf":
        yield
        return
    with sharing_gguf_reads():
        yield


def _install_gguf_caches() -> list[tuple[Any, str, Any]]:
    """Patch the repeated GGUF reads with per-context caches; return how to undo it."""
    try:
        import gguf
        import numpy  # noqa: F401  (the plain reader views the file through it)
        from transformers import modeling_gguf_pytorch_utils as hf_gguf
    except ImportError:
        return []
    caches = _Caches(
        gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint, gguf.dequantize
    )
    patches = [
        (gguf, "GGUFReader", caches.reader_cls),
        (gguf, "get_tensor_name_map", caches.name_map_fn),
        (hf_gguf, "load_gguf_checkpoint", caches.load_fn),
        (hf_gguf, "tqdm", hf_gguf.tqdm),
    ]
    gguf.GGUFReader = caches.reader  # type: ignore[misc,assignment]
    gguf.get_tensor_name_map = caches.name_map
    hf_gguf.load_gguf_checkpoint = caches.load  # type: ignore[assignment]
    hf_gguf.tqdm = lambda iterable, *args, **kwargs: iterable  # its own progress bar, on stderr
    if hasattr(mmap, "MADV_DONTNEED"):
        patches.append((gguf, "dequantize", caches.dequantize_fn))
        gguf.dequantize = caches.dequantize
    return patches


class _Caches:
    """One context's caches, and the functions that stand in for the originals while it is open."""

    def __init__(self, reader_cls: Any, name_map_fn: Any, load_fn: Any, dequantize_fn: Any) -> None:
        self.reader_cls, self.name_map_fn = reader_cls, name_map_fn
        self.load_fn, self.dequantize_fn = load_fn, dequantize_fn
        self.readers: dict[tuple[str, str], Any] = {}
        self.name_maps: dict[tuple[Any, int], Any] = {}
        self.metadata: dict[str, Any] = {}
        self.mapped: list[tuple[int, int, Any]] = []
        """(address, size, mmap) of each file a reader maps."""
        self.read: list[tuple[Any, int, int]] = []
        """(mmap, offset, length) of the bytes the last dequantisation read."""
        self.plain_reader = _plain_reader(reader_cls, self.mapped)
        self.reading_weights = False
        """While the weights load: the reader hides the tokenizer's fields (see _WithoutTokenizer)."""

    def reader(self, path: Any, mode: str = "r") -> Any:
        """gguf.GGUFReader, one per file and mode."""
        key = (os.path.realpath(path), mode)
        if key not in self.readers:
            self.readers[key] = self.plain_reader(path, mode)
        reader = self.readers[key]
        return _WithoutTokenizer(reader) if self.reading_weights else reader

    def name_map(self, arch: Any, n_blocks: int) -> Any:
        """gguf.get_tensor_name_map, one per (architecture, blocks)."""
        if (arch, n_blocks) not in self.name_maps:
            self.name_maps[(arch, n_blocks)] = self.name_map_fn(arch, n_blocks)
        return self.name_maps[(arch, n_blocks)]

    def load(self, path: Any, return_tensors: bool = False, *args: Any, **kwargs: Any) -> Any:
        """transformers' load_gguf_checkpoint: the metadata-only parse once per file (as deep
        copies); the weights, which come last, after freeing it."""
        if return_tensors or args or kwargs:
            self.metadata.clear()  # loading the weights comes last: free the parse before it
            self.reading_weights = bool(return_tensors)
            try:
                return self.load_fn(path, return_tensors, *args, **kwargs)
            finally:
                self.reading_weights = False
        key = os.path.realpath(path)
        if key not in self.metadata:
            self.metadata[key] = self.load_fn(path, False)
        return _fresh(self.metadata[key])

    def release(self) -> None:
        """Let go of the file pages the last dequantisation read."""
        for mm, offset, length in self.read:
            with suppress(OSError, ValueError):
                mm.madvise(mmap.MADV_DONTNEED, offset, length)
        self.read.clear()

    def dequantize(self, data: Any, qtype: Any) -> Any:
        """gguf's dequantize; the file pages the previous tensor was read from are let go
        (transformers has copied that tensor by then), so they do not add up in memory."""
        self.release()
        out = self.dequantize_fn(data, qtype)
        address = data.ctypes.data
        for base, size, mm in self.mapped:
            if base <= address < base + size:
                start = (address - base) // mmap.PAGESIZE * mmap.PAGESIZE
                self.read.append((mm, start, address - base + data.nbytes - start))
        return out


_ATOMS = (str, bytes, int, float, bool, type(None))


def _fresh(value: Any) -> Any:
    """A copy of a metadata parse as deep as deepcopy's, faster: its containers are copied, and
    immutable values (the 49k-long token lists hold only strings) shared."""
    if isinstance(value, list):
        if all(type(v) in _ATOMS for v in value):
            return list(value)
        return [_fresh(v) for v in value]
    if isinstance(value, dict):
        out = copy.copy(value)  # the same mapping type
        for k, v in value.items():
            out[k] = _fresh(v)
        return out
    if type(value) in _ATOMS:
        return value
    return copy.deepcopy(value)


class _WithoutTokenizer:
    """A reader whose `fields` leave out the tokenizer's (`tokenizer.*`), for the weights' load.

    transformers' weights load parses every metadata field again (some 147k values for a 49k
    vocabulary) and keeps only the tensors; its tensor processors read the architecture's keys
    (heads, experts), never the tokenizer's. Everything else is the reader's own."""

    def __init__(self, reader: Any) -> None:
        self._reader = reader

    @property
    def fields(self) -> Any:
        kept = type(self._reader.fields)()
        for key, field in self._reader.fields.items():
            if not key.startswith("tokenizer."):
                kept[key] = field
        return kept

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)


def _plain_reader(reader_cls: Any, mapped: list[tuple[int, int, Any]]) -> Any:
    """A subclass of gguf's reader that parses a plain ndarray view of the file, noting each
    file it maps in mapped."""
    import numpy as np

    class PlainReader(reader_cls):  # type: ignore[misc]
        """The same parse over a plain ndarray view of the file: numpy's memmap subclass runs
        Python code on every slice, and the reader slices once per vocabulary string."""

        @property
        def data(self) -> Any:
            return self._plain

        @data.setter
        def data(self, value: Any) -> None:
            if isinstance(value, np.memmap):
                handle = getattr(value, "_mmap", None)
                if handle is not None:
                    mapped.append((value.ctypes.data, value.nbytes, handle))
                value = value.view(np.ndarray)
            self._plain = value

    return PlainReader
