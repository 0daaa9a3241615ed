"""The decoders: what turns a residual vector read at a layer into logits.

`LogitLens` decodes through the model's own tail (`blocks.ModelDecoder`: final norm, head,
post-head steps, as the model wrote them). `TunedLens` first applies a learned affine translator
per layer: a residual h read at layer l < L becomes h + W_l h + b_l (tuned-lens's
`transform_hidden`: the translator is added residually, so weight decay pulls it toward the
identity), then the model's own tail; the last layer L has no translator, so the engine's
self-check still holds. Both are public objects that work on a caller's own tensors, as
tuned-lens's `LogitLens` and `TunedLens` do; the lens engine runs the same decoders (`Decoder`).
A lens folder (`tuned_folder`) is checked against the model's config before its weights load
(`tuned_folder.fits_tuned`), then against the loaded model (`tuned_through`).

`open_tail`, the model's tail without its blocks: what decoding a saved hidden state needs, and no
more. The model is built from its config on the meta device, every tensor then stands as a zero
that takes no memory (a scalar expanded to the tensor's shape), and the modules that run after the
last block (found by running the tail once on such a model: a final norm, OPT's project_out, the
head) get their tensors read from the checkpoint, each alone. `ModelDecoder` then runs on it as on
the whole model: the model's forward on a dummy token, the block list cut to its last block, whose
output is replaced by the state to decode; the embedding and the last block compute on zeros, and
whatever the model does after its blocks (soft-capping, logit scales, code that is no module) runs
as the model wrote it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from embedlens.analysis.lens.blocks import Blocks, Capture, Decoder, ModelDecoder, find_blocks
from embedlens.analysis.lens.tuned_folder import config_size, head_weight
from embedlens.compat.torch import put_tensor
from embedlens.errors import UnsupportedError, UsageError

if TYPE_CHECKING:
    from embedlens.analysis.lens.jacobian import Transport
    from embedlens.analysis.lens.tuned_folder import Learned
    from embedlens.io.source import ModelSource
    from embedlens.reports.tune import JacobianArtifact
    from embedlens.reports.tune import TunedLens as TunedDescription


@dataclass(frozen=True)
class Translators:
    """One affine translator per layer 0..L-1: weight [L, d, d] and bias [L, d], float32."""

    weight: torch.Tensor
    bias: torch.Tensor
    num_layers: int = field(init=False, compare=False, repr=False)
    """L: the layers with a translator (the model's blocks)."""
    width: int = field(init=False, compare=False, repr=False)
    """d: the residual stream's width."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_layers", int(self.weight.shape[0]))
        object.__setattr__(self, "width", int(self.weight.shape[1]))

    def apply(self, rows: torch.Tensor, layers: Sequence[int]) -> torch.Tensor:
        """Rows [n, d] translated, row i by the translator of layers[i] (none at layer L), in
        float32: h + W h + b."""
        if rows.shape[-1] != self.width:
            raise UsageError(
                f"the tuned lens's translators are {self.width} wide; this model's residual "
                f"stream is {rows.shape[-1]} wide: the lens was tuned for another model"
            )
        h = rows.float()
        out = h.clone()
        at = torch.tensor(list(layers), dtype=torch.long)
        for layer in sorted({int(x) for x in layers if 0 <= x < self.num_layers}):
            pick = (at == layer).nonzero().flatten().to(h.device)
            x = h.index_select(0, pick)
            w = self.weight[layer].to(h.device)
            b = self.bias[layer].to(h.device)
            out.index_copy_(0, pick, x + torch.addmm(b, x, w.T))
        return out


class TunedDecoder:
    """Translator, then the model's own decoder: the tuned lens (with a Jacobian lens's
    `Transport` as its translators: the Jacobian lens). The last layer is decoded untranslated, so the head's hooks, the steps after the last block and the suspect step are
    the model's own decoder's (`full` too: its tail ran with every block in place)."""

    def __init__(self, own: Decoder, translators: Translators | Transport) -> None:
        self.own = own
        self.translators = translators

    @property
    def full(self) -> bool:
        """The model's own decoder's flag."""
        return self.own.full

    @full.setter
    def full(self, value: bool) -> None:
        self.own.full = value

    def logits(self, rows: torch.Tensor, layers: Sequence[int]) -> torch.Tensor:
        """Logits [n, V] of rows [n, d], each translated for the layer it was read at."""
        translated = self.translators.apply(rows, layers)
        return self.own.logits(translated.to(rows.dtype), layers)

    def watch(self, cap: Capture) -> list[Any]:
        return self.own.watch(cap)

    def steps(self, row: torch.Tensor, tol: float) -> list[str]:
        return self.own.steps(row, tol)

    def suspect(self, real: Capture, tol: float) -> str:
        return self.own.suspect(real, tol)


class LogitLens:
    """The logit lens as an object: `LogitLens.from_model(model)(hidden, layer)` decodes a
    residual `hidden` [..., d] read at `layer` (0: the embedding output, i: block i's output)
    through the model's own tail, into float32 logits [..., V]: the `lens` report's figures."""

    def __init__(self, model: nn.Module, decoder: Decoder) -> None:
        self.model = model
        self.decoder = decoder
        self.num_layers = len(find_blocks(model).modules)
        """L: the model's blocks; layers 0..L can be decoded."""

    @classmethod
    def from_model(cls, model: nn.Module, *, dummy_id: int = 0) -> LogitLens:
        """The logit lens of a loaded transformers causal LM (`dummy_id`: the token the tail's
        forward pass runs on, whose embedding is replaced; any id gives the same logits)."""
        return cls(model, ModelDecoder(model, find_blocks(model), dummy_id=dummy_id))

    def __call__(self, hidden: torch.Tensor, layer: int) -> torch.Tensor:
        """Float32 logits [..., V] of residual vectors [..., d] read at `layer`."""
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise UsageError(f"layer must be an int, not {type(layer).__name__}")
        if not 0 <= layer <= self.num_layers:
            raise UsageError(f"layer {layer} is not in 0..{self.num_layers} (the model's blocks)")
        rows = hidden.reshape(-1, hidden.shape[-1])
        with torch.no_grad():
            out = self.decoder.logits(rows, [layer] * rows.shape[0]).float()
        return out.reshape(*hidden.shape[:-1], out.shape[-1])


class TunedLens(LogitLens):
    """The tuned lens as an object: `TunedLens.from_folder(model, folder)(hidden, layer)`, a
    residual [..., d] at `layer` translated, then decoded by the model's own tail."""

    @classmethod
    def from_folder(
        cls, model: nn.Module, folder: str | os.PathLike[str], *, tokenizer: Any = None
    ) -> TunedLens:
        """The tuned lens in `folder` (`embedlens tune`'s, or one tuned-lens saved) on `model`,
        refused for another model (its size, its decoder's weights, and with `tokenizer` its
        vocabulary, as `lens --tuned` checks them)."""
        from embedlens.analysis.lens.tuned_folder import fits_tuned, open_folder

        lens = open_folder(folder)
        fits_tuned(lens, getattr(model, "config", None))
        through = tuned_through(lens, model, tokenizer)
        assert through is not None
        return cls(model, through.decoder(model, 0))


class JacobianLens(LogitLens):
    """The Jacobian lens as an object: `JacobianLens.from_file(model, path)(hidden, layer)`, a
    residual [..., d] at `layer` moved by that layer's matrix (none: the identity), then decoded by
    the model's own tail."""

    @classmethod
    def from_file(cls, model: nn.Module, path: str | os.PathLike[str]) -> JacobianLens:
        """The Jacobian lens in `path` (a file, a folder holding one, or HUB_ID:FILE) on `model`,
        refused for a model of another width or with fewer blocks."""
        from embedlens.analysis.lens.jacobian import open_jacobian

        through = tuned_through(open_jacobian(path), model, None)
        assert through is not None
        return cls(model, through.decoder(model, 0))


@dataclass(frozen=True)
class Through:
    """A learned lens ready for the engine: its translators (or a Jacobian lens's matrices), and
    what reports say of it."""

    translators: Translators | Transport
    described: TunedDescription | JacobianArtifact
    """What reports say of the lens (their `tuned`, or their `jacobian`)."""

    @property
    def fields(self) -> dict[str, Any]:
        """The report's field that names the lens, and its value."""
        from embedlens.reports.tune import JacobianArtifact

        jacobian = isinstance(self.described, JacobianArtifact)
        return {"jacobian" if jacobian else "tuned": self.described}

    def wrap(self, own: Decoder) -> Decoder:
        """The tuned lens's decoder on the model's own."""
        return TunedDecoder(own, self.translators)

    def decoder(self, model: nn.Module, dummy_id: int) -> Decoder:
        """The tuned lens's decoder on `model`'s own (its tail run on `dummy_id`)."""
        return self.wrap(ModelDecoder(model, find_blocks(model), dummy_id=dummy_id))


def tuned_through(
    lens: Learned | None,
    model: nn.Module,
    tokenizer: Any,
    *,
    fingerprints: bool = True,
) -> Through | None:
    """The tuned lens ready for the engine (None without a lens), once it is checked against the
    loaded model (its blocks, its decoder's weights, its vocabulary: without a `tokenizer`, not
    that; without `fingerprints`, its blocks alone: the model compared with the one the lens was
    tuned on, read through that model's lens). A Jacobian lens is checked against the model's
    width and blocks."""
    from embedlens.analysis.lens.jacobian import JacobianFile, Transport
    from embedlens.analysis.lens.tuned_folder import check_model, read_translators
    from embedlens.reports.tune import JacobianArtifact
    from embedlens.reports.tune import TunedLens as Described

    if lens is None:
        return None
    if isinstance(lens, JacobianFile):
        blocks = len(find_blocks(model).modules)
        lens.fits(config_size(getattr(model, "config", None))[0], blocks)
        model_name = lens.metadata.get("model_name")
        described_j = JacobianArtifact(
            path=str(lens.path),
            made_by=lens.made_by,
            model_name=model_name if isinstance(model_name, str) else "",
            n_prompts=lens.n_prompts,
            layers=list(lens.layers),
        )
        return Through(Transport(lens), described_j)
    check_model(lens, model, find_blocks(model), tokenizer, fingerprints=fingerprints)
    described = Described(
        path=str(lens.path),
        made_by=lens.made_by,
        base_model=lens.base_model,
        num_layers=lens.num_layers,
    )
    return Through(Translators(*read_translators(lens)), described)


Reader = tuple[dict[str, str], Callable[[str, torch.dtype], torch.Tensor]]
"""A checkpoint's tensors by model name: model name -> name in the file, and one read alone."""


@dataclass(frozen=True)
class Tail:
    """The model with only the tensors after its last block read; the rest zeros in no memory."""

    model: nn.Module
    blocks: Blocks
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
    hidden = config_size(getattr(model, "config", None))[0]
    if hidden is None:
        raise UnsupportedError("the model's config gives no hidden_size")
    _skip_block(blocks.modules[-1])
    with torch.inference_mode(), _head_skipped(model):
        after = _after_last_block(model, blocks, torch.zeros(hidden, dtype=dtype))
    read = _read(source, model, _tensors_of(model, after), names, dtype)
    return Tail(model, blocks, read)


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every tensor name -> all the names of the same tensor (a tied head: the embedding's)."""
    groups: dict[int, list[str]] = {}
    named = [*model.named_parameters(remove_duplicate=False)]
    for name, t in [*named, *model.named_buffers(remove_duplicate=False)]:
        groups.setdefault(id(t), []).append(name)
    return {name: group for group in groups.values() for name in group}


def _zeros(model: nn.Module, *, in_memory: bool = False) -> None:
    """Every parameter and buffer a zero of its shape and dtype that takes no memory (with
    `in_memory`: zeros in memory)."""

    def zero(t: torch.Tensor) -> torch.Tensor:
        if in_memory:
            return torch.zeros(t.shape, dtype=t.dtype)
        return torch.zeros((), dtype=t.dtype).expand(t.shape)

    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            put_tensor(module, name, nn.Parameter(zero(p), requires_grad=False))
        for name, b in list(module.named_buffers(recurse=False, remove_duplicate=False)):
            put_tensor(module, name, zero(b))


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
    head, weight = head_weight(model)
    if not isinstance(head, nn.Linear) or weight is None:
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


def _after_last_block(model: nn.Module, blocks: Blocks, row: torch.Tensor) -> list[str]:
    """The modules (outermost) that run after the last block, found on one zero state (the
    engine's probe); where a kernel refuses an expanded zero (grouped experts), once more with
    the last block's tensors as zeros in memory (that block alone)."""
    for in_memory in (False, True):
        if in_memory:
            _zeros(blocks.modules[-1], in_memory=True)
        try:
            return list(ModelDecoder(model, blocks, dummy_id=0).probe(row).steps)
        except UnsupportedError:
            raise
        except Exception as e:
            error = e
    raise UnsupportedError(
        f"the model's tail cannot run without its blocks' weights ({type(error).__name__}: {error})"
    ) from error


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
    places, read_one = _reader(source, model)
    for name in wanted:
        found = next((a for a in names.get(name, [name]) if a in places), None)
        if found is None:
            raise UnsupportedError(
                f"'{name}' runs after the last block but the checkpoint of '{source.spec}' does "
                "not hold it: the states cannot be decoded without the model's blocks",
            )
        owner, _, attr = name.rpartition(".")
        is_param = attr in dict(model.get_submodule(owner).named_parameters(recurse=False))
        current = model.get_parameter(name) if is_param else model.get_buffer(name)
        value = read_one(found, current.dtype if not current.is_floating_point() else dtype)
        if tuple(value.shape) != tuple(current.shape):
            raise UnsupportedError(
                f"'{places[found]}' has shape {tuple(value.shape)}, the model's "
                f"'{name}' {tuple(current.shape)}"
            )
        shared = nn.Parameter(value, requires_grad=False) if is_param else value
        for alias in names.get(name, [name]):  # one tensor in every place, as tied
            owner, _, attr = alias.rpartition(".")
            put_tensor(model.get_submodule(owner), attr, shared)
        read.append(places[found])
    return read


def _reader(source: ModelSource, model: nn.Module) -> Reader:
    """How the tail's tensors are read: a GGUF file's; a hub repo's safetensors by HTTP range
    where its weights are not in the hub cache (the headers, then each tensor the tail needs,
    alone: `io.ranges`, kept for later runs); else a safetensors folder's."""
    from embedlens.compat.transformers import tail_tensors
    from embedlens.compat.transformers.direct import safetensors_files

    if source.is_gguf:
        from embedlens.model.files import files_of

        assert source.path is not None
        ckpt = files_of(source).checkpoint  # its header, read once; the same offsets as the file's
        assert ckpt is not None and ckpt.gguf is not None
        # a hub GGUF whole (its tokenizer was built from it), never the sparse copy of its header
        gguf = tail_tensors.GGUFTensors(source.whole_gguf(), ckpt.gguf, model)
        return gguf.places(), gguf.read
    files = None if source.folder is None else safetensors_files(source.folder)
    on_disk = bool(files) and all(path.is_file() for path in files or [])
    if source.kind == "hub" and not on_disk:
        return _hub_reader(source, model)
    if not files:
        raise UnsupportedError(
            f"'{source.spec}' has no safetensors weights on disk: --states reads the final norm "
            "and the head from a local folder's safetensors or a GGUF file",
        )
    places = tail_tensors.folder_places(model, files)

    def read(name: str, dtype: torch.dtype) -> torch.Tensor:
        return tail_tensors.read_folder_tensor(places[name], dtype)

    return {name: place.key for name, place in places.items()}, read


def _hub_reader(source: ModelSource, model: nn.Module) -> Reader:
    """A hub repo's tensors read by HTTP range (`_reader`)."""
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

    return {name: entry.name for name, entry in places.items()}, read
