"""What the config and the checkpoint headers say, and the checks run on them before anything is
counted or loaded: the sizes a checkpoint contradicts, empty tables, integer weights without a
quantization_config. Header reads only: no torch, and nothing here builds or loads a model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from embedlens.errors import CheckpointError, ConfigError
from embedlens.io.checkpoint import Checkpoint, gguf_checkpoint
from embedlens.io.gguf import GGUFHeader, LazyArray
from embedlens.io.source import ModelSource
from embedlens.model.anatomy import find_embedding, find_head, is_buffer_name, place
from embedlens.model.config import ModelConfig, from_dict, parse_config


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
        check_not_empty(ckpt, embedding, find_head(shapes, embedding))


def check_not_empty(ckpt: Checkpoint, embedding: str, head: str | None) -> None:
    """CheckpointError when the embedding or the head (of those read) has a dimension of 0."""
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


def quantisation(config: ModelConfig) -> Any:
    """The config's quantization_config (of the text config for a multimodal one), if any."""
    return config.raw.get("quantization_config") or config.text.get("quantization_config")


def check_integer_weights(
    ckpt: Checkpoint, config: ModelConfig, names: Iterable[str] | None = None
) -> None:
    """CheckpointError for a weight (of `names`, or any) stored as an integer type while
    config.json has no quantization_config: read as floats, its raw integers would pass for
    the model's values. Buffers (position ids, masks) may be integers."""
    if ckpt.format != "safetensors" or isinstance(quantisation(config), dict):
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
