"""Where a model's named tensors are stored, and one of them read, as transformers would load it.

For a decoder without its blocks (`analysis.lens.decoders.open_tail`): the few tensors that run
after the last block are found in the checkpoint by the names transformers' own loader gives them
(its renaming rules for a safetensors folder, `direct.plan_targets`; its GGUF name map and tensor
processors for a GGUF file), and read alone, each from its memory-mapped bytes. Where the shortcuts' gate is
closed (another release), a folder's tensors are found by their model names as they are.

Nothing here imports torch or transformers at module level.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from embedlens.compat.transformers import fast
from embedlens.errors import UnsupportedError

if TYPE_CHECKING:
    import torch

    from embedlens.io.checkpoint import TensorEntry
    from embedlens.io.gguf import GGUFHeader, GGUFTensorInfo

_TORCH_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


@dataclass(frozen=True)
class Stored:
    """One model tensor's place in the checkpoint: its file and its name there."""

    path: Path
    key: str


def folder_places(model: Any, files: list[Path]) -> dict[str, Stored]:
    """Model tensor name -> where a safetensors checkpoint holds it (headers read, no data)."""
    from safetensors import safe_open

    if fast():
        from embedlens.compat.transformers.direct import plan_targets

        try:
            plan = plan_targets(model, files)
        except Exception:  # a release whose renaming rules read otherwise: names as they are
            plan = None
        if plan is not None:
            return {target: Stored(path, key) for target, (path, key) in plan.targets.items()}
    places: dict[str, Stored] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                places.setdefault(key, Stored(path, key))
    return places


def entry_places(model: Any, entries: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
    """Model tensor name -> its entry in a checkpoint whose headers were read by range (a hub
    repo's), by transformers' renaming rules as `folder_places` finds them."""
    if fast():
        from embedlens.compat.transformers.direct import plan_keys

        by_file: dict[str, list[str]] = {}
        for key, entry in entries.items():
            by_file.setdefault(entry.file, []).append(key)
        try:
            plan = plan_keys(model, [(Path(file), keys) for file, keys in by_file.items()])
        except Exception:  # a release whose renaming rules read otherwise: names as they are
            plan = None
        if plan is not None:
            return {target: entries[key] for target, (_, key) in plan.targets.items()}
    return dict(entries)


def read_entry(entry: TensorEntry, dtype: torch.dtype) -> torch.Tensor:
    """One tensor read from the bytes on disk its entry points at (a range kept from the hub),
    converted to `dtype`."""
    import torch

    kind = _TORCH_DTYPES.get(entry.dtype)
    if kind is None:
        raise UnsupportedError(
            f"'{entry.name}' is stored as {entry.dtype}: --states reads F32, F16, BF16 and F64"
        )
    assert entry.path is not None and entry.file_offset is not None
    if not entry.nbytes:
        return torch.zeros(entry.shape, dtype=dtype)
    raw = _as_in_the_file(entry.nbytes, entry.file_offset, getattr(torch, kind).itemsize)
    with open(entry.path, "rb") as fh:
        fh.seek(entry.file_offset - entry.base)
        if fh.readinto(raw.numpy().data) != entry.nbytes:
            raise UnsupportedError(f"'{entry.name}': its bytes on disk are cut short")
    value = raw.view(getattr(torch, kind)).reshape(entry.shape)
    return value.to(dtype=dtype)


ALIGNMENT = 64
"""The bytes torch aligns every CPU tensor to; a CPU's widest vector loads (AVX-512's) are as
wide."""


def _as_in_the_file(nbytes: int, offset: int, itemsize: int) -> torch.Tensor:
    """Room for a tensor's bytes placed as a memory-mapped read of the whole file places them:
    at the file offset's distance past a 64-byte boundary. A matrix-vector product rounds
    according to where its matrix sits on some CPUs (an AMD EPYC's head product over one
    position moved by 2.4e-07 between an aligned copy and the file's place), so a tensor read by
    range decodes to the bytes the same tensor gives read from the file itself."""
    import torch

    lead = offset % ALIGNMENT
    if lead % itemsize:  # a place no tensor of this type can start at: torch's own alignment
        lead = 0
    return torch.empty(nbytes + lead, dtype=torch.uint8)[lead:]


def read_folder_tensor(place: Stored, dtype: torch.dtype) -> torch.Tensor:
    """One tensor of a safetensors file, read alone and converted to `dtype`."""
    from safetensors import safe_open

    with safe_open(str(place.path), framework="pt", device="cpu") as handle:
        value: torch.Tensor = handle.get_slice(place.key)[...]
    return value.to(dtype=dtype)


class GGUFTensors:
    """A GGUF file's tensors by the model names transformers gives them, read one at a time
    (dequantised and processed as transformers' GGUF loader does). The tensor table is the one
    embedlens read from the header (`header`; `path` the whole file, where a hub GGUF's header
    was read from a copy of its first bytes): gguf's reader, which parses every metadata field
    first, is not needed to find two tensors."""

    def __init__(self, path: Path, header: GGUFHeader, model: Any) -> None:
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
        )

        self.path = path
        arch = str(header.meta("general.architecture", ""))
        self.config = model.config.to_dict()
        processor: Any = TENSOR_PROCESSORS.get(arch, TensorProcessor)
        self.processor = processor(config=self.config)
        try:
            to_model = get_gguf_hf_weights_map(model, self.processor)
        except Exception as e:
            raise UnsupportedError(
                f"cannot map the tensors of '{path.name}' to the model's names: {e}"
            ) from e
        self.mapping = to_model
        stored = header.tensors
        self.by_model = {hf: g for g, hf in to_model.items() if g in stored}
        self._stored = stored

    def places(self) -> dict[str, str]:
        """Model tensor name -> the GGUF tensor's name."""
        return dict(self.by_model)

    def read(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The model tensor `name`, from its GGUF tensor alone, converted to `dtype`."""
        import numpy as np
        import torch
        from gguf import GGMLQuantizationType, dequantize

        gguf_name = self.by_model[name]
        info = self._stored[gguf_name]
        weights = dequantize(gguf_data(self.path, info), GGMLQuantizationType(info.type_id))
        parsed: dict[str, Any] = {"config": self.config, "tensors": {}}
        result = self.processor.process(
            weights=weights,
            name=gguf_name,
            tensor_key_mapping=self.mapping,
            parsed_parameters=parsed,
        )
        return torch.from_numpy(np.copy(result.weights)).to(dtype=dtype)


def gguf_data(path: Path, info: GGUFTensorInfo) -> Any:
    """A GGUF tensor's bytes memory-mapped as gguf's reader presents them (`.data`): plain
    numbers in their own dtype and shape, a quantised tensor as rows of bytes."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    qtype = GGMLQuantizationType(info.type_id)
    plain = {
        GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
        GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
        GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
        GGMLQuantizationType.I64: np.int64,
    }  # fmt: skip
    dims = tuple(reversed(info.ggml_shape))
    n = int(np.prod(dims))
    if qtype in plain:
        kind: Any = plain[qtype]
        count, shape = n, dims
    else:
        block, size = GGML_QUANT_SIZES[qtype]
        kind, count, shape = np.uint8, n * size // block, quant_shape_to_byte_shape(dims, qtype)
    return np.memmap(path, dtype=kind, mode="r", offset=info.offset, shape=(count,)).reshape(shape)
