"""The model's tail without its blocks: what decoding a saved hidden state needs, and no more.

The model is built from its config on the meta device, every tensor then stands as a zero that
takes no memory (a scalar expanded to the tensor's shape), and the modules that run after the last
block (found by running the tail once on such a model: a final norm, OPT's project_out, the head)
get their tensors read from the checkpoint, each alone. `ModelDecoder` then runs on it as on the
whole model: the model's forward on a dummy token, the block list cut to its last block, whose
output is replaced by the state to decode; the embedding and the last block compute on zeros, and
whatever the model does after its blocks (soft-capping, logit scales, code that is no module) runs
as the model wrote it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from embedlens.analysis.lens.blocks import Blocks, ModelDecoder, find_blocks
from embedlens.compat.torch import put_tensor
from embedlens.errors import UnsupportedError

if TYPE_CHECKING:
    from embedlens.io.source import ModelSource


@dataclass(frozen=True)
class Tail:
    """The model with only the tensors after its last block read; the rest zeros in no memory."""

    model: nn.Module
    blocks: Blocks
    modules: list[str]
    """The modules that run after the last block, outermost, in order."""
    read: list[str]
    """The checkpoint tensors read (their names in the file), in order."""


def open_tail(source: ModelSource, dtype: torch.dtype, *, trust_remote_code: bool) -> Tail:
    """The model of `source` built without weights, the tensors after its last block read."""
    from embedlens.model.loading import build_meta_model

    model = build_meta_model(source, trust_remote_code=trust_remote_code)
    model.to(dtype)
    names = _aliases(model)
    _zeros(model)
    model.eval()
    blocks = find_blocks(model)
    hidden = _hidden_size(model)
    _skip_block(blocks.modules[-1])
    with torch.inference_mode(), _head_skipped(model):
        after = _after_last_block(model, blocks, hidden, dtype)
    wanted = _tensors_of(model, after)
    read = _read(source, model, wanted, names, dtype)
    return Tail(model, blocks, after, read)


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every tensor name -> all the names of the same tensor (a tied head: the embedding's)."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    for name, b in model.named_buffers(remove_duplicate=False):
        groups.setdefault(id(b), []).append(name)
    return {name: group for group in groups.values() for name in group}


def _zeros(model: nn.Module, *, in_memory: bool = False) -> None:
    """Every parameter and buffer a zero of its shape and dtype that takes no memory (with
    `in_memory`: zeros in memory)."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            put_tensor(module, name, nn.Parameter(_zero(p, in_memory), requires_grad=False))
        for name, b in list(module.named_buffers(recurse=False, remove_duplicate=False)):
            put_tensor(module, name, _zero(b, in_memory))


def _zero(t: torch.Tensor, in_memory: bool = False) -> torch.Tensor:
    if in_memory:
        return torch.zeros(t.shape, dtype=t.dtype)
    return torch.zeros((), dtype=t.dtype).expand(t.shape)


def is_placeholder(t: torch.Tensor) -> bool:
    """Whether a tensor of the tail is one of its zeros (not read from the checkpoint)."""
    return t.dim() > 0 and all(s == 0 for s in t.stride())


def _skip_block(block: nn.Module) -> None:
    """The last block returns its input unchanged instead of computing on zeros, where its
    forward says it returns one tensor, the hidden states it takes first: the lens replaces
    that output whole with the state to decode, so nothing computed from it changes, and the
    block's weights (zeros that take no memory) are never expanded into memory by its kernels
    (3 x 470 MB for a Llama-3-70B MLP)."""
    import inspect

    try:
        signature = inspect.signature(type(block).forward)
    except (TypeError, ValueError):
        return
    params = list(signature.parameters)
    if signature.return_annotation is not torch.Tensor or params[1:2] != ["hidden_states"]:
        return

    def forward(*args: Any, **kwargs: Any) -> Any:
        return args[0] if args else kwargs["hidden_states"]

    vars(block)["forward"] = forward  # this module's alone (an instance attribute)


@contextmanager
def _head_skipped(model: nn.Module) -> Iterator[None]:
    """While the tail is probed (its outputs are zeros, only which modules run matters): the
    head, a linear map, returns zeros of its output's shape without expanding its zero weight
    into memory (the whole head's bytes, 2.1 GB for Llama-3-70B's)."""
    get_head: Any = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    weight = getattr(head, "weight", None)
    if not isinstance(head, nn.Linear) or not isinstance(weight, torch.Tensor):
        yield
        return
    rows = int(weight.shape[0])

    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros((*x.shape[:-1], rows))

    vars(head)["forward"] = forward
    try:
        yield
    finally:
        del vars(head)["forward"]


def _hidden_size(model: nn.Module) -> int:
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text, "hidden_size", None)
    if not isinstance(size, int):
        raise UnsupportedError("the model's config gives no hidden_size")
    return size


def _after_last_block(
    model: nn.Module, blocks: Blocks, hidden: int, dtype: torch.dtype
) -> list[str]:
    """The modules (outermost) that run after the last block, found on one zero state."""
    row = torch.zeros(hidden, dtype=dtype)
    try:
        probe = ModelDecoder(model, blocks, dummy_id=0).probe(row)  # the engine's discovery
    except UnsupportedError:
        raise
    except Exception:
        # a kernel that refuses an expanded zero (grouped experts): the last block's tensors as
        # zeros in memory (that block alone), and once more
        _zeros(blocks.modules[-1], in_memory=True)
        try:
            probe = ModelDecoder(model, blocks, dummy_id=0).probe(row)
        except UnsupportedError:
            raise
        except Exception as e:
            raise UnsupportedError(
                f"the model's tail cannot run without its blocks' weights ({type(e).__name__}: {e})"
            ) from e
    return list(probe.steps)


def _tensors_of(model: nn.Module, modules: list[str]) -> list[str]:
    """The parameters and buffers of `modules`, by their full names, each once."""
    out: list[str] = []
    for prefix in modules:
        module = model.get_submodule(prefix)
        for name, _ in [*module.named_parameters(), *module.named_buffers()]:
            full = f"{prefix}.{name}" if prefix else name
            if full not in out:
                out.append(full)
    return out


def _read(
    source: ModelSource,
    model: nn.Module,
    wanted: list[str],
    names: dict[str, list[str]],
    dtype: torch.dtype,
) -> list[str]:
    """Read each wanted tensor from the checkpoint into every place it has (a tied head's
    embedding too); the names read, as the file has them."""
    read: list[str] = []
    reader = _reader(source, model)
    for name in wanted:
        found = next((a for a in names.get(name, [name]) if a in reader.places), None)
        if found is None:
            raise UnsupportedError(
                f"'{name}' runs after the last block but the checkpoint of '{source.spec}' does "
                "not hold it: the states cannot be decoded without the model's blocks",
            )
        current = model.get_parameter(name) if _is_param(model, name) else model.get_buffer(name)
        value = reader.read(found, current.dtype if not current.is_floating_point() else dtype)
        if tuple(value.shape) != tuple(current.shape):
            raise UnsupportedError(
                f"'{reader.places[found]}' has shape {tuple(value.shape)}, the model's "
                f"'{name}' {tuple(current.shape)}"
            )
        shared = nn.Parameter(value, requires_grad=False) if _is_param(model, name) else value
        for alias in names.get(name, [name]):  # one tensor in every place, as tied
            _put(model, alias, shared)
        read.append(reader.places[found])
    return read


def _is_param(model: nn.Module, name: str) -> bool:
    owner, _, attr = name.rpartition(".")
    return attr in dict(model.get_submodule(owner).named_parameters(recurse=False))


def _put(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    put_tensor(model.get_submodule(owner), attr, value)


class _Reader:
    """One checkpoint's tensors by model name: `places` (model name -> name in the file) and
    `read` (one tensor, alone)."""

    def __init__(self, places: dict[str, str], read: Any) -> None:
        self.places = places
        self._read = read

    def read(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        value: torch.Tensor = self._read(name, dtype)
        return value


def _reader(source: ModelSource, model: nn.Module) -> _Reader:
    """How the tail's tensors are read: a GGUF file's, or a safetensors folder's."""
    from embedlens.compat.transformers import tail_tensors

    if source.is_gguf:
        from embedlens.model.files import files_of

        assert source.path is not None
        ckpt = files_of(source).checkpoint  # its header, read once; the same offsets as the file's
        assert ckpt is not None and ckpt.gguf is not None
        # a hub GGUF whole (its tokenizer was built from it), never the sparse copy of its header
        gguf = tail_tensors.GGUFTensors(source.whole_gguf(), ckpt.gguf, model)
        return _Reader(gguf.places(), gguf.read)
    if source.kind == "hub" and not _on_disk(source):
        return _hub_reader(source, model)
    files = _safetensors(source)
    places = tail_tensors.folder_places(model, files)

    def read(name: str, dtype: torch.dtype) -> torch.Tensor:
        return tail_tensors.read_folder_tensor(places[name], dtype)

    return _Reader({name: place.key for name, place in places.items()}, read)


def _on_disk(source: ModelSource) -> bool:
    """Whether a hub repo's weights are in the hub cache (then read from there)."""
    from embedlens.compat.transformers.direct import safetensors_files

    folder = source.folder
    files = None if folder is None else safetensors_files(folder)
    return bool(files) and all(path.is_file() for path in files or [])


def _hub_reader(source: ModelSource, model: nn.Module) -> _Reader:
    """A hub repo's tensors read by HTTP range: the safetensors headers, then each tensor the
    tail needs, alone (`io.ranges`; kept for later runs)."""
    from embedlens.compat.transformers import tail_tensors
    from embedlens.io.checkpoint import open_checkpoint
    from embedlens.model.matrix import on_disk

    ckpt = open_checkpoint(source)
    if ckpt is None or ckpt.format != "safetensors":
        raise UnsupportedError(
            f"'{source.spec}' has no safetensors weights: --states reads the final norm and the "
            "head of a hub repo's safetensors by range",
        )
    places = tail_tensors.entry_places(model, ckpt.tensors)

    def read(name: str, dtype: torch.dtype) -> torch.Tensor:
        return tail_tensors.read_entry(on_disk(source, places[name]), dtype)

    return _Reader({name: entry.name for name, entry in places.items()}, read)


def _safetensors(source: ModelSource) -> list[Path]:
    """The folder's safetensors files (one, or the shards of its index)."""
    from embedlens.compat.transformers.direct import safetensors_files

    folder = source.folder
    files = None if folder is None else safetensors_files(folder)
    if not files:
        raise UnsupportedError(
            f"'{source.spec}' has no safetensors weights on disk: --states reads the final norm "
            "and the head from a local folder's safetensors or a GGUF file",
        )
    return files
