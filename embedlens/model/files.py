"""A source's files read once (`ModelFiles`): its config (config.json as plain JSON, no
transformers import, or a GGUF file's metadata) and its checkpoint's headers, checked with
embedlens' own checks before transformers reads the model (`check_source`): a config that is no
causal LM, the sizes a checkpoint contradicts, empty tables, integer weights without a
quantization_config. The tokenizer, the memory check and the model are built from it; nothing
after goes back to the files for what it holds. Header reads only: no torch here.
"""

from __future__ import annotations

import importlib.util
import json
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embedlens.errors import CheckpointError, ConfigError, RemoteCodeError, UnsupportedError
from embedlens.io.checkpoint import Checkpoint, gguf_checkpoint, open_checkpoint
from embedlens.io.gguf import GGUFHeader, LazyArray
from embedlens.io.source import ModelSource
from embedlens.model.anatomy import find_embedding, find_tables, is_buffer_name, stored_layers

_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
_NOT_CAUSAL_SUFFIXES = (
    "ForMaskedLM",
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
    "ForMultipleChoice",
    "ForPreTraining",
    "ForNextSentencePrediction",
    "ForImageClassification",
)
_ENCODER_ONLY_TYPES = {
    "bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2",
    "mpnet", "camembert", "modernbert", "xlm", "ernie", "nomic_bert", "esm",
}  # fmt: skip

_VOCAB_KEYS = ("vocab_size", "n_vocab", "padded_vocab_size")
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model", "dim", "model_dim")
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_EXPERT_KEYS = ("num_local_experts", "n_routed_experts", "num_experts", "moe_num_experts")
_TOPK_KEYS = ("num_experts_per_tok", "moe_top_k", "num_selected_experts", "top_k")


@dataclass(frozen=True)
class ModelConfig:
    """The facts embedlens needs from a config, read without transformers."""

    raw: dict[str, Any]
    text: dict[str, Any] = field(default_factory=dict)
    """The language-model part: `text_config` for multimodal wrappers, else the whole config."""

    model_type: str | None = field(init=False, compare=False, repr=False)
    """config.model_type (of the language model)."""
    vocab_size: int | None = field(init=False, compare=False, repr=False)
    """The vocabulary size (rows of the embedding matrix)."""
    hidden_size: int | None = field(init=False, compare=False, repr=False)
    """The model width d."""
    num_layers: int | None = field(init=False, compare=False, repr=False)
    """The number of decoder blocks."""
    tie_word_embeddings: bool | None = field(init=False, compare=False, repr=False)
    """The tie flag as written (OLMo's weight_tying too), or None when the config is silent."""
    num_experts: int | None = field(init=False, compare=False, repr=False)
    """Routed experts per MoE layer, if this is a mixture-of-experts model."""
    experts_per_token: int | None = field(init=False, compare=False, repr=False)
    """Routed experts each token uses."""
    dtype: str | None = field(init=False, compare=False, repr=False)
    """The checkpoint's dtype as the config states it (`dtype` or `torch_dtype`)."""

    def __post_init__(self) -> None:
        """The figures above, read once from the config when it is made."""
        text, both = self.text, (self.text, self.raw)
        model_type = text.get("model_type") or self.raw.get("model_type")
        found: dict[str, Any] = {
            "model_type": str(model_type) if model_type else None,
            "vocab_size": _first_int(text, _VOCAB_KEYS),
            "hidden_size": _first_int(text, _HIDDEN_KEYS),
            "num_layers": _first_int(text, _LAYER_KEYS),
            "tie_word_embeddings": _tie_flag(both),
            "num_experts": _first_int(text, _EXPERT_KEYS),
            "experts_per_token": _first_int(text, _TOPK_KEYS),
            "dtype": _dtype_named(both),
        }
        for name, value in found.items():
            object.__setattr__(self, name, value)

    @property
    def has_auto_map(self) -> bool:
        """Whether the config points at code in the model's repository (`auto_map`)."""
        auto_map = self.raw.get("auto_map")
        return isinstance(auto_map, dict) and bool(auto_map)

    @property
    def needs_remote_code(self) -> bool:
        """Whether loading would run code from the model's repository."""
        return self.has_auto_map and not is_native_model_type(self.raw.get("model_type"))

    def builtin_code_note(self, *, trust_remote_code: bool) -> str | None:
        """What to tell the user when transformers builds this model with its own class although
        the repository ships code (`auto_map` over a model type transformers has built in)."""
        if not self.has_auto_map or self.needs_remote_code or trust_remote_code:
            return None
        return (
            f"the repository's own model code (auto_map) was not run: transformers' built-in "
            f"'{self.raw.get('model_type')}' implementation was used; --trust-remote-code would "
            "run the repository's code instead"
        )


def _tie_flag(configs: tuple[dict[str, Any], ...]) -> bool | None:
    """The first tie flag written (tie_word_embeddings, or OLMo's weight_tying), else None."""
    for config in configs:
        for key in ("tie_word_embeddings", "weight_tying"):
            if isinstance(config.get(key), bool):
                return bool(config[key])
    return None


def _dtype_named(configs: tuple[dict[str, Any], ...]) -> str | None:
    """The first dtype named (`dtype` or `torch_dtype`), else None."""
    for config in configs:
        value = config.get("dtype") or config.get("torch_dtype")
        if isinstance(value, str):
            return value
    return None


def _first_int(d: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = d.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def is_native_model_type(model_type: object) -> bool:
    """Whether transformers ships this model_type, found on disk without importing transformers."""
    if not isinstance(model_type, str) or not model_type:
        return False
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return False
    models = Path(next(iter(spec.submodule_search_locations))) / "models"
    return (models / model_type.replace("-", "_")).is_dir()


# Nesting a config.json may have: real ones need three or four levels, while transformers walks
# a config recursively (copying, comparing, printing it), which a deep one turns into a crash.
MAX_DEPTH = 32


def _depth(value: object) -> int:
    """How deeply lists and objects nest in a parsed JSON value (walked without recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = (
            item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        )
        if children is None:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_DEPTH:
            return deepest
        stack.extend((child, level + 1) for child in children)
    return deepest


def parse_config(path: Path, *, trust_remote_code: bool = False) -> ModelConfig:
    """Read and check config.json; raise ConfigError with a clear reason when it is not usable."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read '{path}': {e}") from e
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"'{path}' is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
        ) from e
    except RecursionError as e:
        raise ConfigError(f"'{path}' is nested too deeply to be a config") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"'{path}' does not hold a JSON object")
    depth = _depth(raw)
    if depth > MAX_DEPTH:
        raise ConfigError(
            f"'{path}' is nested {depth} levels deep (a config needs a few; at most "
            f"{MAX_DEPTH} are read)"
        )
    config = from_dict(raw)
    check_causal_lm(config, str(path))
    if config.needs_remote_code and not trust_remote_code:
        raise RemoteCodeError(
            f"model type '{raw.get('model_type')}' needs code from the model's repository",
            hint="embedlens never runs a model's own code unless you pass --trust-remote-code",
        )
    return config


def from_dict(raw: dict[str, Any]) -> ModelConfig:
    """Wrap a config dict, picking the language model's part of a multimodal config."""
    text = raw
    for key in ("text_config", "language_config", "llm_config"):
        sub = raw.get(key)
        if isinstance(sub, dict) and any(k in sub for k in _HIDDEN_KEYS):
            text = sub
            break
    return ModelConfig(raw=raw, text=text)


def check_causal_lm(config: ModelConfig, where: str) -> None:
    """Refuse configs of encoder-only or encoder-decoder models."""
    raw = config.raw
    archs = [a for a in raw.get("architectures") or [] if isinstance(a, str)]
    name = archs[0] if archs else raw.get("model_type", "?")
    if raw.get("is_encoder_decoder") is True:
        raise ConfigError(
            f"'{name}' is an encoder-decoder model, not a causal LM",
            hint="embedlens reads decoder-only causal language models",
        )
    if archs and not any(a.endswith(_CAUSAL_SUFFIXES) for a in archs):
        if any(a.endswith(_NOT_CAUSAL_SUFFIXES) for a in archs) or (
            config.model_type in _ENCODER_ONLY_TYPES
        ):
            raise ConfigError(
                f"'{name}' is not a causal LM (architecture {', '.join(archs)})",
                hint="embedlens reads decoder-only causal language models",
            )
    elif not archs and config.model_type in _ENCODER_ONLY_TYPES:
        raise ConfigError(
            f"model type '{config.model_type}' is an encoder-only model, not a causal LM",
            hint="embedlens reads decoder-only causal language models",
        )
    for label, value in (("vocabulary size", config.vocab_size), ("width", config.hidden_size)):
        if value is not None and value <= 0:
            raise ConfigError(f"config in '{where}' gives a {label} of {value}")


def gguf_config(header: GGUFHeader) -> ModelConfig:
    """A config dict from GGUF metadata, with the keys a HF config would use."""
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    n_tokens = tokens.count if isinstance(tokens, LazyArray) else None
    if isinstance(tokens, list):
        n_tokens = len(tokens)
    raw: dict[str, Any] = {
        "model_type": header.metadata.get("general.architecture"),
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


def mismatches(
    config: ModelConfig, ckpt: Checkpoint, embedding: str | None = None
) -> list[tuple[str, int, int]]:
    """Where the config and the checkpoint's shapes disagree: (what, config's figure, stored
    figure) for the embedding's rows (vocabulary size), its width, and the number of blocks.
    `embedding`: the embedding's name where it was found already (`tables`)."""
    shapes = {name: t.shape for name, t in ckpt.tensors.items()}
    if embedding is None:
        embedding = find_embedding(shapes, config.vocab_size)
    out: list[tuple[str, int, int]] = []
    if embedding in shapes and len(shapes[embedding]) == 2:  # not in a shard left unread
        rows, width = shapes[embedding]
        if config.vocab_size is not None and config.vocab_size != rows:
            out.append(("vocabulary size (embedding rows)", config.vocab_size, rows))
        said = _embedding_width(config)
        if said is not None and said != width:
            out.append(("width", said, width))
    layers = stored_layers(shapes)
    said_layers = config.num_layers
    if layers and said_layers is not None:
        extra = config.text.get("num_nextn_predict_layers")  # DeepSeek-V3's stored MTP block
        allowed = {said_layers} | ({said_layers + extra} if isinstance(extra, int) else set())
        if layers not in allowed:
            out.append(("layers", said_layers, layers))
    return out


def _embedding_width(config: ModelConfig) -> int | None:
    """The embedding's row length the config implies (OPT's word_embed_proj_dim, ALBERT-style
    embedding_size, else the model width)."""
    for key in ("word_embed_proj_dim", "embedding_size"):
        value = config.text.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return config.hidden_size


def check_matches(
    source: ModelSource, config: ModelConfig, ckpt: Checkpoint, embedding: str | None
) -> None:
    """Refuse (ConfigError) a config whose sizes the checkpoint's shapes contradict: transformers
    would allocate the config's sizes, then fail or fill the difference with random values.
    `embedding`: as `mismatches` takes it."""
    if quant_settings(config) is not None:  # packed tensors are checked at their logical shapes
        from embedlens.model.quant import unpack

        ckpt = unpack(ckpt, quant_settings(config)).checkpoint
    found = mismatches(config, ckpt, embedding)
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


def tables(ckpt: Checkpoint, config: ModelConfig) -> tuple[str | None, str | None]:
    """The names of the embedding and the head among the checkpoint's tensors (None: not found;
    a tied head has none of its own), after the check that neither has no rows or rows of width
    0 (CheckpointError)."""
    # Tensors whose shard was not read (offline, `open_checkpoint(partial=True)`) are known by
    # name: a matrix named as the embedding or the head is still found, shaped [?, ?] (-1, -1).
    shapes = {**{n: (-1, -1) for n in ckpt.unread}, **{n: t.shape for n, t in ckpt.tensors.items()}}
    embedding, head = find_tables(shapes, config.vocab_size)
    if embedding is not None:
        check_not_empty(ckpt, embedding, head)
    return embedding, head


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


def quant_settings(config: ModelConfig) -> Any:
    """The config's quantisation settings: quantization_config, else MLX's `quantization`."""
    return quantisation(config) or config.raw.get("quantization")


def check_integer_weights(
    ckpt: Checkpoint, config: ModelConfig, names: Iterable[str] | None = None
) -> None:
    """CheckpointError for a weight (of `names`, or any) stored as an integer type while
    config.json has no quantization_config: read as floats, its raw integers would pass for
    the model's values. Buffers (position ids, masks) may be integers."""
    if ckpt.format != "safetensors" or isinstance(quantisation(config), dict):
        return
    mlx = config.raw.get("quantization")
    if isinstance(mlx, dict) and "bits" in mlx:
        raise UnsupportedError(
            f"this checkpoint is quantised by MLX ({mlx.get('bits')} bits, groups of "
            f"{mlx.get('group_size')}), which transformers cannot load",
            hint="`embedlens params` counts it from its headers; load the unquantised model "
            "for the other commands",
        )
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


@dataclass(frozen=True)
class ModelFiles:
    """What a source's files say, read and checked once: every tensor's header entry (None when
    the weights are neither safetensors nor GGUF) and the config (config.json, or a GGUF file's
    metadata)."""

    source: ModelSource
    checkpoint: Checkpoint | None
    config: ModelConfig
    embedding: str | None = None
    """The embedding's tensor name in the checkpoint (None: not found, or no headers read)."""
    head: str | None = None
    """The head's own tensor name (None: tied, not found, or no headers read)."""
    trust_remote_code: bool = field(default=False, compare=False)
    """Whether the files were read for a load that may run the repository's code."""
    config_json: dict[str, Any] | None = field(init=False, compare=False, repr=False)
    """config.json as JSON (None for a GGUF file, whose config is its metadata)."""
    code_note: str | None = field(init=False, compare=False, repr=False)
    """The note that transformers' built-in class stands for the repository's own code
    (`ModelConfig.builtin_code_note`), None where there is nothing to say."""

    def __post_init__(self) -> None:
        raw = None if self.source.is_gguf else self.config.raw
        object.__setattr__(self, "config_json", raw)
        trust = self.trust_remote_code
        note = self.config.builtin_code_note(trust_remote_code=trust)
        object.__setattr__(self, "code_note", note)


_Read = tuple[Checkpoint | None, ModelConfig, str | None, str | None]
"""What check_source read of a source: its headers, its config, the embedding's and head's names."""

_READ: dict[int, dict[bool, _Read]] = {}
"""What check_source read, by id() of the source and trust_remote_code (an entry goes with its
source, so an id used again starts unread; it holds no reference to the source)."""


def _read(source: ModelSource) -> dict[bool, _Read]:
    """The files read of `source`, by the trust_remote_code they were checked with."""
    key = id(source)
    read = _READ.get(key)
    if read is None:
        read = _READ[key] = {}
        weakref.finalize(source, _READ.pop, key, None)
    return read


def check_source(source: ModelSource, *, trust_remote_code: bool = False) -> ModelFiles:
    """The config and every checkpoint header, read with embedlens' own checks (once per source
    and trust_remote_code) before transformers reads the model: a corrupt file, an encoder-only
    config or one that needs remote code ends in embedlens' error, not in transformers' (or in a
    crash). The config's sizes agree with the checkpoint's shapes once this has passed."""
    read = _read(source)
    kept = read.get(trust_remote_code)
    if kept is not None:
        return ModelFiles(source, *kept, trust_remote_code)

    ckpt = open_checkpoint(source)
    config = read_config(source, ckpt, trust_remote_code=trust_remote_code)
    embedding = head = None
    if ckpt is not None:
        embedding, head = tables(ckpt, config)
        check_matches(source, config, ckpt, embedding)
        check_integer_weights(ckpt, config)
    read[trust_remote_code] = ckpt, config, embedding, head
    return ModelFiles(source, ckpt, config, embedding, head, trust_remote_code)


def files_of(given: ModelSource | ModelFiles, *, trust_remote_code: bool = False) -> ModelFiles:
    """`given` as read already, else its files read now (`check_source`)."""
    if isinstance(given, ModelFiles):
        return given
    return check_source(given, trust_remote_code=trust_remote_code)
