"""A file `torch.save` wrote (its zip format), read without running its pickle's code and without
reading its tensors until one is asked for.

The zip's directory is read, then its `data.pkl` by an unpickler that builds plain containers
(dict, list, tuple, str, numbers, bool, None, OrderedDict) and tensors alone: any other global the
pickle names is refused, so nothing in the file runs, as torch's weights-only unpickler refuses
it. A tensor is kept as where its bytes lie (`LazyTensor`: its storage's record, dtype, offset,
size, stride); `load()` reads that one record, so a file on the hub is read by range, a tensor at
a time (`RangeFile`). Legacy (pre-zip) files are not read here.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from embedlens.compat.torch import PICKLED_TENSOR
from embedlens.errors import CheckpointError

if TYPE_CHECKING:
    import torch

STORAGES = {
    "HalfStorage": "float16",
    "FloatStorage": "float32",
    "BFloat16Storage": "bfloat16",
    "DoubleStorage": "float64",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
}
"""The typed storages a tensor's bytes may be saved as, by class name, and their dtypes."""
_BLOCK = 1 << 16
"""Bytes a `RangeFile` reads at once for the zip's small reads (its directory, headers)."""


@dataclass(frozen=True)
class _Storage:
    key: str
    dtype: str


@dataclass(frozen=True)
class LazyTensor:
    """A tensor of the file, not read: where its bytes are, and its view of them."""

    archive: zipfile.ZipFile
    record: str
    dtype: str
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.size

    def load(self) -> torch.Tensor:
        """The tensor, its storage's record read now (and only it)."""
        import torch

        data = bytearray(self.archive.read(self.record))
        flat = torch.frombuffer(data, dtype=getattr(torch, self.dtype)) if data else None
        if flat is None:
            return torch.empty(self.size, dtype=getattr(torch, self.dtype))
        return flat.as_strided(self.size, self.stride, self.offset).clone()


class _Unpickler(pickle.Unpickler):
    """data.pkl's objects: plain containers and `LazyTensor`s; any other global is refused."""

    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str) -> None:
        super().__init__(io.BytesIO(data))
        self.archive = archive
        self.prefix = prefix

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if (module, name) == PICKLED_TENSOR:
            return self._tensor
        if module == "torch" and name in STORAGES:
            return STORAGES[name]
        raise pickle.UnpicklingError(f"Unsupported global: {module}.{name}")

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"Unsupported persistent id {str(pid)[:80]}")
        _, dtype, key, _location, _numel = pid
        if not isinstance(dtype, str) or not isinstance(key, str):
            raise pickle.UnpicklingError("Unsupported storage")
        return _Storage(key, dtype)

    def _tensor(self, storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> LazyTensor:
        if not isinstance(storage, _Storage):
            raise pickle.UnpicklingError("a tensor without a storage")
        record = f"{self.prefix}data/{storage.key}"
        view = int(offset), tuple(size), tuple(stride)
        return LazyTensor(self.archive, record, storage.dtype, *view)


def read_payload(file: IO[bytes], name: str) -> Any:
    """The object `torch.save` wrote to `file` (named `name` in errors), its tensors lazy."""
    try:
        archive = zipfile.ZipFile(file)
        pkl = [n for n in archive.namelist() if n.endswith("data.pkl") and n.count("/") == 1]
        if len(pkl) != 1:
            raise CheckpointError(f"'{name}' is not a file torch.save wrote (no data.pkl)")
        prefix = pkl[0][: -len("data.pkl")]
        order = b"little"
        if f"{prefix}byteorder" in archive.namelist():
            order = archive.read(f"{prefix}byteorder").strip()
        if order != b"little":
            raise CheckpointError(f"'{name}' was saved big-endian: embedlens reads little-endian")
        return _Unpickler(archive.read(pkl[0]), archive, prefix).load()
    except pickle.UnpicklingError as e:
        raise refused(name, str(e), "a Jacobian-lens artifact holds tensors only") from None
    except (zipfile.BadZipFile, EOFError, ValueError, KeyError, TypeError, IndexError) as e:
        raise CheckpointError(f"cannot read '{name}': {type(e).__name__}: {str(e)[:160]}") from None


def refused(name: str, reason: str, what: str) -> CheckpointError:
    """The error for a file whose pickle asks for more than tensors (`what`: what it should
    hold, the hint's start)."""
    return CheckpointError(
        f"'{name}' is not a plain file of tensors: its pickle asks for more than tensors "
        f"({reason[:160]}); refused, and nothing in it ran",
        hint=f"{what}; get it from a source you trust",
    )


def weights_only(path: str, what: str) -> Any:
    """A torch file read whole by torch's weights-only unpickler (a legacy file too); a pickle
    asking for more than tensors and plain containers is refused unread (`refused`)."""
    import warnings

    import torch

    try:
        with warnings.catch_warnings():  # torch's note on a legacy file's pickle protocol
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise refused(path, first, what) from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        raise CheckpointError(f"cannot read '{path}': {str(e)[:200]}") from None


class RangeFile(io.RawIOBase):
    """A read-only file of `size` bytes whose bytes come from `read(start, stop)`: the zip's small
    reads served from blocks kept in memory, a large read asked for whole."""

    def __init__(self, size: int, read: Callable[[int, int], bytes]) -> None:
        super().__init__()
        self.size = size
        self._read = read
        self._pos = 0
        self._blocks: dict[int, bytes] = {}

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), max(0, self.size - self._pos))
        if n == 0:
            return 0
        start = self._pos
        if n >= _BLOCK:
            data = self._read(start, start + n)
        else:
            first, last = start // _BLOCK, (start + n - 1) // _BLOCK
            data = b"".join(self._block(i) for i in range(first, last + 1))
            data = data[start - first * _BLOCK : start - first * _BLOCK + n]
        buffer[:n] = data
        self._pos += n
        return n

    def _block(self, i: int) -> bytes:
        if i not in self._blocks:
            self._blocks[i] = self._read(i * _BLOCK, min(self.size, (i + 1) * _BLOCK))
        return self._blocks[i]
