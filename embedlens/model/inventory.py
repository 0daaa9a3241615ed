"""An inventory of a model's unique parameters, from checkpoint headers or from built modules.

Both `params` and `tied` start here. Header inventories import no torch; module inventories take
a model already built (on the meta device or loaded) and only read its attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from embedlens.errors import CheckpointError, UnsupportedError, UsageError
from embedlens.io.checkpoint import (
    TORCH_DTYPE_NAMES,
    Checkpoint,
    TensorEntry,
    open_checkpoint,
)
from embedlens.io.source import ModelSource
from embedlens.io.tensor_bytes import same_bytes
from embedlens.model.anatomy import is_buffer_name, stored_layers
from embedlens.model.files import (
    ModelConfig,
    mismatches,
    quant_settings,
    quantisation,
    read_config,
    tables,
)
from embedlens.model.quant import Bookkeeping, unpack
from embedlens.model.quant.pricing import PRICEABLE, method_of, price

InventoryMode = Literal["header", "meta", "weights"]

DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1}


@dataclass(frozen=True)
class Item:
    """One unique parameter tensor."""

    name: str
    shape: tuple[int, ...]
    numel: int
    nbytes: int | None
    dtype: str | None = None


@dataclass
class Inventory:
    """A model's unique parameters and the facts needed to group them."""

    items: list[Item]
    embedding: str | None
    head: str | None
    """The output matrix's name when it is a tensor of its own (untied), else None."""
    tied: bool
    vocab_size: int
    hidden_size: int
    num_layers: int
    dtype: str | None
    config: ModelConfig
    stored_head: str | None = None
    """A head tensor the checkpoint stores even though it is tied (counted once)."""
    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    bookkeeping: list[Bookkeeping] = field(default_factory=list)
    """Quantisation state stored beside the parameters (scales, zero points, indices)."""
    quantised: bool = False
    """Whether any parameter is stored quantised (or, on the meta device, priced so)."""
    packed: frozenset[str] = frozenset()
    """The parameters stored quantised (their values packed or scaled), by name."""
    stated_total: int | None = None
    """The parameter count the checkpoint's metadata states, where it states one."""
    bookkeeping_known: bool = True
    """False where the bookkeeping's bytes could not be priced (--meta-only, a format whose
    state embedlens cannot price from the config)."""

    @property
    def embedding_shape(self) -> tuple[int, ...]:
        """[V, d] of the input embedding."""
        for item in self.items:
            if item.name == self.embedding:
                return item.shape
        return (self.vocab_size, self.hidden_size)


def from_checkpoint(ckpt: Checkpoint, config: ModelConfig) -> Inventory:
    """Inventory from headers: buffers skipped, a tied head stored twice counted once, packed
    weights counted as the parameters they hold (their scales and zero points apart)."""
    unpacked = unpack(ckpt, quant_settings(config))
    ckpt = unpacked.checkpoint
    shapes = {name: t.shape for name, t in ckpt.tensors.items()}
    skipped = sorted(n for n, s in shapes.items() if is_buffer_name(n, s))
    embedding, found_head = tables(ckpt, config)  # an unread tensor's shape is [-1, -1]
    if embedding is None:
        raise CheckpointError(
            "no input embedding found among the checkpoint's tensors",
            hint="expected a tensor named like 'model.embed_tokens.weight' of shape [V, d]",
        )
    stored = shapes.get(embedding, (-1, -1))  # [?, ?] in a shard left unread
    notes: list[str] = []
    head, stored_head = _stored_head(ckpt, config, embedding, found_head, notes)
    labels = unpacked.labels
    items = [
        Item(
            n, t.shape, t.numel, t.nbytes, labels.get(n) or TORCH_DTYPE_NAMES.get(t.dtype, t.dtype)
        )
        for n, t in ckpt.tensors.items()
        if n not in skipped and n != stored_head
    ]
    dtypes = {t.dtype for n, t in ckpt.tensors.items() if n not in skipped and n not in labels}
    _warn_packed(config, dtypes, notes)
    v = stored[0]
    layers = stored_layers(shapes)
    disagree = _disagreements(config, ckpt, embedding, notes)
    hidden = config.hidden_size if config.hidden_size and "width" not in disagree else None
    return Inventory(
        items=items,
        embedding=embedding,
        head=head,
        tied=head is None,
        vocab_size=v if v > 0 else config.vocab_size or 0,
        hidden_size=hidden or stored[-1],
        num_layers=layers if "layers" in disagree or not config.num_layers else config.num_layers,
        dtype=_quantised_dtype(items) if labels else _header_dtype(ckpt, dtypes),
        config=config,
        stored_head=stored_head,
        skipped=skipped,
        notes=notes,
        bookkeeping=unpacked.bookkeeping,
        quantised=unpacked.quantised,
        packed=frozenset(labels),
        stated_total=ckpt.stated_total,
    )


def _quantised_dtype(items: list[Item]) -> str:
    """What a quantised checkpoint's parameters hold: 'mixed (bfloat16, int4 (...) + ...)'."""
    kinds = sorted({i.dtype or "?" for i in items})
    return kinds[0] if len(kinds) == 1 else "mixed (" + ", ".join(kinds) + ")"


def _stored_head(
    ckpt: Checkpoint, config: ModelConfig, embedding: str, head: str | None, notes: list[str]
) -> tuple[str | None, str | None]:
    """(the head counted apart from the embedding, a head stored as a copy of the tied
    embedding), each None when there is none; notes where the config and the stored tensors
    disagree on tying."""
    if head is not None and config.tie_word_embeddings is True:
        equal = (
            None
            if head in ckpt.unread or embedding in ckpt.unread
            else same_bytes(ckpt.tensors[embedding], ckpt.tensors[head])
        )
        if equal is False:
            notes.append(
                f"the config ties the head to the embedding, but the checkpoint stores a "
                f"different '{head}'; transformers keeps the two apart, so it is counted as untied"
            )
            return head, None
        notes.append(
            f"the checkpoint stores '{head}' as a copy of the embedding although the "
            "head is tied; it is counted once"
        )
        return None, head
    if head is None and config.tie_word_embeddings is False:
        notes.append(
            "the config says the head is untied, but the checkpoint stores no head matrix; "
            "transformers would tie it or start it from random values"
        )
    return head, None


def _header_dtype(ckpt: Checkpoint, dtypes: set[str]) -> str | None:
    """The one dtype of the stored tensors (torch's name for it); 'mixed (...)' for a GGUF file
    of several; None for a safetensors checkpoint of several."""
    if ckpt.format == "gguf" and len(dtypes) > 1:
        return "mixed (" + ", ".join(sorted(dtypes)) + ")"
    if len(dtypes) != 1:
        return None
    (only,) = dtypes
    return TORCH_DTYPE_NAMES.get(only, only)


def _disagreements(
    config: ModelConfig, ckpt: Checkpoint, embedding: str, notes: list[str]
) -> dict[str, tuple[int, int]]:
    """What the config and the checkpoint disagree on (by label), each noted in notes."""
    found = mismatches(config, ckpt, embedding)
    disagree = {label: (said, stored) for label, said, stored in found}
    for label, (said, stored) in disagree.items():
        notes.append(
            f"the config and the checkpoint disagree: the config says {label} {said:,}, the "
            f"checkpoint stores {stored:,}; the figures here are the checkpoint's"
        )
    return disagree


def _warn_packed(config: ModelConfig, dtypes: set[str], notes: list[str]) -> None:
    quant = quantisation(config)
    if isinstance(quant, dict) and dtypes & {"I32", "U32", "U8"}:
        method = quant.get("quant_method", "quantised")
        notes.append(
            f"this checkpoint is {method}: packed integer tensors of a layout embedlens does not "
            "know are counted as stored elements, not as the parameters they hold; use "
            "--meta-only for the unpacked count"
        )


def from_model(model: Any, config: ModelConfig, *, loaded: bool) -> Inventory:
    """Inventory from built modules (meta or loaded); tied weights appear once."""
    embed_module = model.get_input_embeddings()
    head_module = model.get_output_embeddings()
    if embed_module is None or getattr(embed_module, "weight", None) is None:
        raise UnsupportedError(f"{type(model).__name__} has no input embedding matrix")
    names: dict[int, str] = {}
    items: list[Item] = []
    for name, p in model.named_parameters():  # remove_duplicate=True: tied weights once
        names[id(p)] = name
        size = p.element_size() if loaded else DTYPE_BYTES.get(_config_dtype(config), 4)
        kind = str(p.dtype).removeprefix("torch.") if loaded else _config_dtype(config)
        items.append(Item(name, tuple(p.shape), p.numel(), p.numel() * size, kind))
    quant = None if loaded else quant_settings(config)
    priced = _priced(model, items, quant, config) if quant is not None else None
    embedding = names.get(id(embed_module.weight))
    head_weight = getattr(head_module, "weight", None) if head_module is not None else None
    tied = head_weight is not None and head_weight is embed_module.weight
    head = None if tied or head_weight is None else names.get(id(head_weight))
    v, d = tuple(embed_module.weight.shape)
    if loaded:
        dtypes = {str(p.dtype).removeprefix("torch.") for p in model.parameters()}
        dtype = next(iter(dtypes)) if len(dtypes) == 1 else "mixed"
    else:
        dtype = _config_dtype(config)
    inv = Inventory(
        items=items,
        embedding=embedding,
        head=head,
        tied=tied,
        vocab_size=v,
        hidden_size=d,
        num_layers=config.num_layers or stored_layers({i.name: i.shape for i in items}),
        dtype=dtype,
        config=config,
    )
    mtp = config.text.get("num_nextn_predict_layers")
    if not loaded and isinstance(mtp, int) and mtp > 0:
        inv.notes.append(
            f"the config names {mtp} multi-token-prediction layer{'s' if mtp > 1 else ''} "
            "(num_nextn_predict_layers) that transformers does not build: not counted here; a "
            "checkpoint that stores them counts them from its headers"
        )
    held = _held(items, quant_settings(config)) if loaded and quant_settings(config) else None
    if held is not None:  # a model transformers keeps packed (compressed-tensors, FP8)
        inv.items, inv.bookkeeping, inv.packed = held
        inv.quantised = True
        inv.dtype = _quantised_dtype(inv.items)
    if priced is not None:
        inv.items, inv.bookkeeping, note = priced
        inv.quantised = any(b for b in inv.bookkeeping) or any(i.dtype != dtype for i in inv.items)
        inv.dtype = _quantised_dtype(inv.items)
        inv.bookkeeping_known = note is None
        inv.notes.append(note or PRICED_NOTE)
    return inv


PRICED_NOTE = (
    "bytes are priced from the config's quantization_config, as its quantiser stores each "
    "weight (values, scales, zero points); a file's own bytes may differ by a few headers"
)


def _priced(
    model: Any, items: list[Item], quant: Any, config: ModelConfig
) -> tuple[list[Item], list[Bookkeeping], str | None]:
    """The items priced as the quantization_config stores them, their bookkeeping, and a note
    where the config's format cannot be priced (bytes stay at the config's dtype)."""
    method = method_of(quant)
    if method not in PRICEABLE:
        note = (
            f"--meta-only cannot price the bytes of quant_method '{method or '?'}' from the "
            "config: they are at the config's dtype, as if unquantised"
        )
        return items, [], note
    classes = {name: type(m).__name__ for name, m in model.named_modules()}
    base = DTYPE_BYTES.get(_config_dtype(config), 2)
    out: list[Item] = []
    book: list[Bookkeeping] = []
    for item in items:
        kind = _kind(classes.get(item.name.rpartition(".")[0], ""), item)
        p = price(item.name, item.shape, kind, quant, base)
        if p is None:
            out.append(item)
            continue
        out.append(Item(item.name, item.shape, item.numel, p.nbytes, p.label))
        book.extend(Bookkeeping(item.name, k, b, item.name) for k, b in p.book if b)
    return out, book, None


_SAFETENSORS_OF = {v: k for k, v in TORCH_DTYPE_NAMES.items()} | {"uint32": "U32"}


def _held(
    items: list[Item], quant: Any
) -> tuple[list[Item], list[Bookkeeping], frozenset[str]] | None:
    """A loaded model's parameters read as a checkpoint's headers would be: where transformers
    keeps the weights packed (compressed-tensors' `weight_packed`, FP8 with its scales), the
    parameters they hold and the bookkeeping beside them; None where nothing is packed."""
    entries = {}
    for i in items:
        dtype = _SAFETENSORS_OF.get(i.dtype or "")
        if dtype is None:
            return None
        entries[i.name] = TensorEntry(i.name, dtype, i.shape, "", None, None, i.nbytes or 0)
    unpacked = unpack(Checkpoint("safetensors", entries, ()), quant)
    if not unpacked.quantised:
        return None
    labels = unpacked.labels
    out = [
        Item(n, t.shape, t.numel, t.nbytes, labels.get(n) or TORCH_DTYPE_NAMES.get(t.dtype))
        for n, t in unpacked.checkpoint.tensors.items()
    ]
    return out, unpacked.bookkeeping, frozenset(labels)


def _kind(owner: str, item: Item) -> str:
    """What pricing needs of a parameter's module: 'Linear', 'Embedding', 'Experts' (fused
    3-D expert projections), else ''."""
    if owner.endswith("Linear") and item.name.endswith(".weight"):
        return "Linear"
    if owner.endswith("Embedding") and item.name.endswith(".weight"):
        return "Embedding"
    if owner.endswith("Experts") and len(item.shape) == 3:
        return "Experts"
    return ""


def _config_dtype(config: ModelConfig) -> str:
    dtype = config.dtype
    return dtype if dtype in DTYPE_BYTES else "float32"


def take_inventory(
    source: ModelSource,
    mode: InventoryMode | None,
    *,
    trust_remote_code: bool = False,
    dtype: str = "auto",
    device: str = "cpu",
) -> tuple[Inventory, InventoryMode, Any]:
    """Inventory by the asked mode; by default from headers, else from the config on meta.

    Returns the inventory, the mode used, and the built model (None in header mode).
    """
    if mode in (None, "header"):
        config = (
            None if source.is_gguf else read_config(source, trust_remote_code=trust_remote_code)
        )
        ckpt = open_checkpoint(source)
        if ckpt is not None:
            config = config or read_config(source, ckpt)
            return from_checkpoint(ckpt, config), "header", None
        if mode == "header":
            raise CheckpointError(
                f"'{source.spec}' has no safetensors or GGUF weights whose headers could be read",
                hint="use --meta-only to count from the config alone",
            )
        mode = "meta"
    from embedlens.model import loading

    config = read_config(source, trust_remote_code=trust_remote_code)
    built_in = config.builtin_code_note(trust_remote_code=trust_remote_code)
    if mode == "meta":
        if source.is_gguf:
            raise UsageError(
                "--meta-only needs a config.json; a GGUF file is counted from its header",
                hint="drop --meta-only",
            )
        model = loading.build_meta_model(source, trust_remote_code=trust_remote_code)
        inv = from_model(model, config, loaded=False)
    else:
        notes: list[str] = []
        model = loading.load_model(
            source, dtype=dtype, device=device, trust_remote_code=trust_remote_code, notes=notes
        )
        inv = from_model(model, config, loaded=True)
        inv.notes.extend(notes)
    if built_in is not None:
        inv.notes.append(built_in)
    return inv, mode, model
