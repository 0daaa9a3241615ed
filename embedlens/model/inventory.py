"""An inventory of a model's unique parameters, from checkpoint headers or from built modules.

Both `params` and `tied` start here. Header inventories import no torch; module inventories take
a model already built (on the meta device or loaded) and only read its attributes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from embedlens.errors import CheckpointError, ConfigError, UnsupportedError, UsageError
from embedlens.io.checkpoint import (
    TORCH_DTYPE_NAMES,
    Checkpoint,
    gguf_checkpoint,
    open_checkpoint,
    same_bytes,
)
from embedlens.io.gguf import GGUFHeader, LazyArray
from embedlens.io.source import ModelSource
from embedlens.model.anatomy import find_embedding, find_head, is_buffer_name, place
from embedlens.model.config import ModelConfig, from_dict, parse_config

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

    @property
    def embedding_shape(self) -> tuple[int, ...]:
        """[V, d] of the input embedding."""
        for item in self.items:
            if item.name == self.embedding:
                return item.shape
        return (self.vocab_size, self.hidden_size)


def gguf_config(header: GGUFHeader) -> ModelConfig:
    """A config dict from GGUF metadata, with the keys a HF config would use."""
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    n_tokens = tokens.count if isinstance(tokens, LazyArray) else None
    if isinstance(tokens, list):
        n_tokens = len(tokens)
    raw: dict[str, Any] = {
        "model_type": header.meta("general.architecture"),
        "vocab_size": header.meta("{arch}.vocab_size") or n_tokens,
        "hidden_size": header.meta("{arch}.embedding_length"),
        "num_hidden_layers": header.meta("{arch}.block_count"),
        "num_local_experts": header.meta("{arch}.expert_count"),
        "num_experts_per_tok": header.meta("{arch}.expert_used_count"),
    }
    return from_dict({k: v for k, v in raw.items() if v is not None})


def from_checkpoint(ckpt: Checkpoint, config: ModelConfig) -> Inventory:
    """Inventory from headers: buffers skipped, a tied head stored twice counted once."""
    shapes = {name: t.shape for name, t in ckpt.tensors.items()}
    skipped = sorted(n for n, s in shapes.items() if is_buffer_name(n, s))
    # Tensors whose shard was not read (offline) are known by name: a matrix named as the
    # embedding or the head is still found, with an unknown [?, ?] shape (-1, -1).
    named = {**{n: (-1, -1) for n in ckpt.unread}, **shapes}
    embedding = find_embedding(named, config.vocab_size)
    if embedding is None:
        raise CheckpointError(
            "no input embedding found among the checkpoint's tensors",
            hint="expected a tensor named like 'model.embed_tokens.weight' of shape [V, d]",
        )
    found_head = find_head(named, embedding)
    _check_not_empty(ckpt, embedding, found_head)
    notes: list[str] = []
    head, stored_head = _stored_head(ckpt, config, embedding, found_head, notes)
    items = [
        Item(n, t.shape, t.numel, t.nbytes, TORCH_DTYPE_NAMES.get(t.dtype, t.dtype))
        for n, t in ckpt.tensors.items()
        if n not in skipped and n != stored_head
    ]
    dtypes = {t.dtype for n, t in ckpt.tensors.items() if n not in skipped}
    _warn_packed(config, dtypes, notes)
    v = named[embedding][0]
    stored_layers = _count_layers(items)
    disagree = _disagreements(config, ckpt, notes)
    hidden = config.hidden_size if config.hidden_size and "width" not in disagree else None
    return Inventory(
        items=items,
        embedding=embedding,
        head=head,
        tied=head is None,
        vocab_size=v if v > 0 else config.vocab_size or 0,
        hidden_size=hidden or named[embedding][-1],
        num_layers=stored_layers
        if "layers" in disagree or not config.num_layers
        else config.num_layers,
        dtype=_header_dtype(ckpt, dtypes),
        config=config,
        stored_head=stored_head,
        skipped=skipped,
        notes=notes,
    )


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
    config: ModelConfig, ckpt: Checkpoint, notes: list[str]
) -> dict[str, tuple[int, int]]:
    """What the config and the checkpoint disagree on (by label), each noted in notes."""
    disagree = {label: (said, stored) for label, said, stored in mismatches(config, ckpt)}
    for label, (said, stored) in disagree.items():
        notes.append(
            f"the config and the checkpoint disagree: the config says {label} {said:,}, the "
            f"checkpoint stores {stored:,}; the figures here are the checkpoint's"
        )
    return disagree


def mismatches(config: ModelConfig, ckpt: Checkpoint) -> list[tuple[str, int, int]]:
    """Where the config and the checkpoint's shapes disagree: (what, config's figure, stored
    figure) for the embedding's rows (vocabulary size), its width, and the number of blocks."""
    shapes = {name: t.shape for name, t in ckpt.tensors.items()}
    embedding = find_embedding(shapes, config.vocab_size)
    out: list[tuple[str, int, int]] = []
    if embedding is not None and len(shapes[embedding]) == 2:
        rows, width = shapes[embedding]
        if config.vocab_size is not None and config.vocab_size != rows:
            out.append(("vocabulary size (embedding rows)", config.vocab_size, rows))
        said = _embedding_width(config)
        if said is not None and said != width:
            out.append(("width", said, width))
    layers = {
        place(n, embedding=(), head=()).layer for n, s in shapes.items() if not is_buffer_name(n, s)
    }
    layers.discard(None)
    said_layers = config.num_layers
    if layers and said_layers is not None:
        extra = config.text.get("num_nextn_predict_layers")  # DeepSeek-V3's stored MTP block
        allowed = {said_layers} | ({said_layers + extra} if isinstance(extra, int) else set())
        if len(layers) not in allowed:
            out.append(("layers", said_layers, len(layers)))
    return out


def _embedding_width(config: ModelConfig) -> int | None:
    """The embedding's row length the config implies (OPT's word_embed_proj_dim, ALBERT-style
    embedding_size, else the model width)."""
    for key in ("word_embed_proj_dim", "embedding_size"):
        value = config.text.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return config.hidden_size


def check_matches(source: ModelSource, config: ModelConfig, ckpt: Checkpoint) -> None:
    """Refuse (ConfigError) a config whose sizes the checkpoint's shapes contradict: transformers
    would allocate the config's sizes, then fail or fill the difference with random values."""
    found = mismatches(config, ckpt)
    if not found:
        return
    label, said, stored = found[0]
    what = "config.json" if not source.is_gguf else "the GGUF metadata"
    more = f" (and {len(found) - 1} more disagreement)" if len(found) > 1 else ""
    raise ConfigError(
        f"{what} of '{source.spec}' says {label} {said:,}, but the checkpoint stores "
        f"{stored:,}{more}: the model would not be the one stored",
        hint="fix the config to match the weights (params and tied read the weights as stored)",
    )


def check_tables(ckpt: Checkpoint, config: ModelConfig) -> None:
    """CheckpointError when the embedding or the head has no rows or rows of width 0."""
    shapes = {name: t.shape for name, t in ckpt.tensors.items()}
    embedding = find_embedding(shapes, config.vocab_size)
    if embedding is not None:
        _check_not_empty(ckpt, embedding, find_head(shapes, embedding))


def _check_not_empty(ckpt: Checkpoint, embedding: str, head: str | None) -> None:
    for name in (embedding, head):
        if name is None or name not in ckpt.tensors:  # a tensor in a shard left unread
            continue
        shape = ckpt.tensors[name].shape
        if 0 in shape:
            raise CheckpointError(
                f"'{ckpt.tensors[name].file}' is corrupt: its "
                f"{'head' if name == head else 'embedding'} '{name}' has shape {list(shape)}, "
                f"with {'no rows' if shape[0] == 0 else 'rows of width 0'}"
            )


INTEGER_DTYPES = frozenset({"I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64", "BOOL"})
"""Safetensors dtypes that hold integers: weights only a quantization_config can explain."""


def _quantisation(config: ModelConfig) -> Any:
    return config.raw.get("quantization_config") or config.text.get("quantization_config")


def check_integer_weights(
    ckpt: Checkpoint, config: ModelConfig, names: Iterable[str] | None = None
) -> None:
    """CheckpointError for a weight (of `names`, or any) stored as an integer type while
    config.json has no quantization_config: read as floats, its raw integers would pass for
    the model's values. Buffers (position ids, masks) may be integers."""
    if ckpt.format != "safetensors" or isinstance(_quantisation(config), dict):
        return
    wanted = None if names is None else set(names)
    found = [
        t
        for name, t in ckpt.tensors.items()
        if (wanted is None or name in wanted)
        and t.dtype in INTEGER_DTYPES
        and not is_buffer_name(name, t.shape)
        and not (name.endswith(".bias") and len(t.shape) == 4)  # a causal mask
    ]
    if not found:
        return
    more = f" ({len(found)} tensors in all are)" if len(found) > 1 else ""
    raise CheckpointError(
        f"{found[0].name} is stored as {found[0].dtype}, an integer type{more}, and config.json "
        "has no quantization_config to say how to read it",
        hint="embedlens reads weights as floating-point values; a quantised checkpoint needs the "
        "quantization_config its quantiser wrote",
    )


def _warn_packed(config: ModelConfig, dtypes: set[str], notes: list[str]) -> None:
    quant = _quantisation(config)
    if isinstance(quant, dict) and dtypes & {"I32", "U32", "U8"}:
        method = quant.get("quant_method", "quantised")
        notes.append(
            f"this checkpoint is {method}: packed integer tensors are counted as stored elements, "
            "not as the parameters they hold; use --meta-only for the unpacked count"
        )


def _count_layers(items: list[Item]) -> int:
    from embedlens.model.anatomy import place

    layers = {place(i.name, embedding=(), head=()).layer for i in items}
    layers.discard(None)
    return len(layers)


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
    return Inventory(
        items=items,
        embedding=embedding,
        head=head,
        tied=tied,
        vocab_size=v,
        hidden_size=d,
        num_layers=config.num_layers or _count_layers(items),
        dtype=dtype,
        config=config,
    )


def _config_dtype(config: ModelConfig) -> str:
    dtype = config.dtype
    return dtype if dtype in DTYPE_BYTES else "float32"


def read_config(
    source: ModelSource, ckpt: Checkpoint | None = None, *, trust_remote_code: bool = False
) -> ModelConfig:
    """The model's config: config.json, or for a GGUF file its metadata."""
    if source.is_gguf:
        if ckpt is None or ckpt.gguf is None:
            assert source.path is not None
            ckpt = gguf_checkpoint(source.path)
        assert ckpt.gguf is not None
        return gguf_config(ckpt.gguf)
    return parse_config(source.file("config.json"), trust_remote_code=trust_remote_code)


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
