"""Read config.json as plain JSON (no transformers import) and check it describes a causal LM."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embedlens.errors import ConfigError, RemoteCodeError

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

    @property
    def model_type(self) -> str | None:
        """config.model_type (of the language model)."""
        value = self.text.get("model_type") or self.raw.get("model_type")
        return str(value) if value else None

    @property
    def vocab_size(self) -> int | None:
        """The vocabulary size (rows of the embedding matrix)."""
        return _first_int(self.text, _VOCAB_KEYS)

    @property
    def hidden_size(self) -> int | None:
        """The model width d."""
        return _first_int(self.text, _HIDDEN_KEYS)

    @property
    def num_layers(self) -> int | None:
        """The number of decoder blocks."""
        return _first_int(self.text, _LAYER_KEYS)

    @property
    def tie_word_embeddings(self) -> bool | None:
        """The tie flag as written (OLMo's weight_tying too), or None when the config is silent."""
        for source in (self.text, self.raw):
            for key in ("tie_word_embeddings", "weight_tying"):
                if isinstance(source.get(key), bool):
                    return bool(source[key])
        return None

    @property
    def num_experts(self) -> int | None:
        """Routed experts per MoE layer, if this is a mixture-of-experts model."""
        return _first_int(self.text, _EXPERT_KEYS)

    @property
    def experts_per_token(self) -> int | None:
        """Routed experts each token uses."""
        return _first_int(self.text, _TOPK_KEYS)

    @property
    def dtype(self) -> str | None:
        """The checkpoint's dtype as the config states it (`dtype` or `torch_dtype`)."""
        for source in (self.text, self.raw):
            value = source.get("dtype") or source.get("torch_dtype")
            if isinstance(value, str):
                return value
        return None

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
