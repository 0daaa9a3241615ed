"""An inventory of a model's unique parameters, from checkpoint headers or from built modules.

Both `params` and `tied` start here. Header inventories import no torch; module inventories take
a model already built (on the meta device or loaded) and only read its attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from embedlens.anatomy import find_embedding, find_head, is_buffer_name
from embedlens.checkpoint import (
    TORCH_DTYPE_NAMES,
    Checkpoint,
    gguf_checkpoint,
    open_checkpoint,
    same_bytes,
)
from embedlens.errors import CheckpointError, UnsupportedError, UsageError
from embedlens.gguf_header import GGUFHeader, LazyArray
from embedlens.modelconfig import ModelConfig, from_dict, parse_config
from embedlens.source import ModelSource

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
    embedding = find_embedding(shapes, config.vocab_size)
    if embedding is None:
        raise CheckpointError(
            "no input embedding found among the checkpoint's tensors",
            hint="expected a tensor named like 'model.embed_tokens.weight' of shape [V, d]",
        )
    head = find_head(shapes, embedding)
    _check_not_empty(ckpt, embedding, head)
    notes: list[str] = []
    stored_head = None
    tied = head is None
    if head is not None and config.tie_word_embeddings is True:
        equal = same_bytes(ckpt.tensors[embedding], ckpt.tensors[head])
        if equal is False:
            notes.append(
                f"the config ties the head to the embedding, but the checkpoint stores a "
                f"different '{head}'; transformers keeps the two apart, so it is counted as untied"
            )
        else:
            tied, stored_head, head = True, head, None
            notes.append(
                f"the checkpoint stores '{stored_head}' as a copy of the embedding although the "
                "head is tied; it is counted once"
            )
    elif head is None and config.tie_word_embeddings is False:
        notes.append(
            "the config says the head is untied, but the checkpoint stores no head matrix; "
            "transformers would tie it or start it from random values"
        )
    items = [
        Item(n, t.shape, t.numel, t.nbytes, TORCH_DTYPE_NAMES.get(t.dtype, t.dtype))
        for n, t in ckpt.tensors.items()
        if n not in skipped and n != stored_head
    ]
    dtypes = {t.dtype for n, t in ckpt.tensors.items() if n not in skipped}
    dtype = (
        TORCH_DTYPE_NAMES.get(next(iter(dtypes)), next(iter(dtypes))) if len(dtypes) == 1 else None
    )
    if ckpt.format == "gguf" and len(dtypes) > 1:
        dtype = "mixed (" + ", ".join(sorted(dtypes)) + ")"
    _warn_packed(config, dtypes, notes)
    v, d = shapes[embedding][0], shapes[embedding][-1]
    return Inventory(
        items=items,
        embedding=embedding,
        head=head,
        tied=tied,
        vocab_size=config.vocab_size or v,
        hidden_size=config.hidden_size or d,
        num_layers=config.num_layers or _count_layers(items),
        dtype=dtype,
        config=config,
        stored_head=stored_head,
        skipped=skipped,
        notes=notes,
    )


def check_tables(ckpt: Checkpoint, config: ModelConfig) -> None:
    """CheckpointError when the embedding or the head has no rows or rows of width 0."""
    shapes = {name: t.shape for name, t in ckpt.tensors.items()}
    embedding = find_embedding(shapes, config.vocab_size)
    if embedding is not None:
        _check_not_empty(ckpt, embedding, find_head(shapes, embedding))


def _check_not_empty(ckpt: Checkpoint, embedding: str, head: str | None) -> None:
    for name in (embedding, head):
        shape = ckpt.tensors[name].shape if name is not None else (1,)
        if name is not None and 0 in shape:
            raise CheckpointError(
                f"'{ckpt.tensors[name].file}' is corrupt: its "
                f"{'head' if name == head else 'embedding'} '{name}' has shape {list(shape)}, "
                f"with {'no rows' if shape[0] == 0 else 'rows of width 0'}"
            )


def _warn_packed(config: ModelConfig, dtypes: set[str], notes: list[str]) -> None:
    quant = config.raw.get("quantization_config") or config.text.get("quantization_config")
    if isinstance(quant, dict) and dtypes & {"I32", "U32", "U8"}:
        method = quant.get("quant_method", "quantised")
        notes.append(
            f"this checkpoint is {method}: packed integer tensors are counted as stored elements, "
            "not as the parameters they hold; use --meta-only for the unpacked count"
        )


def _count_layers(items: list[Item]) -> int:
    from embedlens.anatomy import place

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
    from embedlens import loading

    config = read_config(source, trust_remote_code=trust_remote_code)
    if mode == "meta":
        if source.is_gguf:
            raise UsageError(
                "--meta-only needs a config.json; a GGUF file is counted from its header",
                hint="drop --meta-only",
            )
        model = loading.build_meta_model(source, trust_remote_code=trust_remote_code)
        return from_model(model, config, loaded=False), "meta", model
    model = loading.load_model(
        source, dtype=dtype, device=device, trust_remote_code=trust_remote_code
    )
    return from_model(model, config, loaded=True), "weights", model
