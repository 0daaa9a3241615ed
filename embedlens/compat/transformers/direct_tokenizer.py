"""A folder's tokenizer.json through the `tokenizers` library, as transformers' own generic
tokenizer reads it.

When `tokenizer_config.json` names transformers' generic class (`TokenizersBackend`, formerly
`PreTrainedTokenizerFast`), `AutoTokenizer` loads tokenizer.json into that class, and the ids it
gives are the `tokenizers` library's own: what transformers adds around it (special tokens named
in the config, added tokens listed again) changes nothing when each of those is already an added
token of tokenizer.json with the same settings, which is checked here. A config that names a
model's own class (`GPT2Tokenizer`, `Qwen2Tokenizer`, ...: transformers rebuilds the tokenizer
from the vocabulary its own way), repository code, settings that change encoding or decoding
(`split_special_tokens`, `clean_up_tokenization_spaces`, `fix_mistral_regex`) or a token
transformers would add leave the tokenizer to transformers (`open_tokenizer` returns None).
tests/test_direct_tokenizer.py compares the ids with transformers' on every fixture.

`DirectTokenizer` answers what embedlens asks of a tokenizer (encode, decode, one token's entry,
its length, the unknown and special tokens, the chat template) the way transformers' tokenizer
answers it; chat templates are rendered by transformers' own `apply_chat_template`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from embedlens.compat.transformers import fast

if TYPE_CHECKING:
    from tokenizers import Tokenizer

GENERIC = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
"""transformers' generic tokenizer class, under its two names."""
_NOT_REBUILT = frozenset({*GENERIC, "PythonBackend", "MistralCommonBackend"})
"""Registered names AutoTokenizer does not prefer over the config's generic class."""
SPECIAL = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES)."""
_CHANGES_TEXT = ("split_special_tokens", "clean_up_tokenization_spaces", "fix_mistral_regex")
_TOKEN_FLAGS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
_LEGACY_FILES = ("special_tokens_map.json", "added_tokens.json")
CHAT_TEMPLATE = "chat_template.jinja"
CHAT_TEMPLATES = "additional_chat_templates"


class DirectTokenizer:
    """tokenizer.json as transformers' generic tokenizer uses it (see the module's docstring)."""

    is_fast = True

    def __init__(
        self, backend: Tokenizer, special: dict[str, str], extra: list[str], chat: Any, name: str
    ) -> None:
        backend.no_truncation()  # transformers turns both off for a call that asks neither
        backend.no_padding()
        backend.encode_special_tokens = False
        self._tokenizer = backend
        self._special = special
        self.chat_template = chat
        self.name_or_path = name
        self.backend_tokenizer = backend
        """The `tokenizers` tokenizer."""
        for token in {*SPECIAL, *special}:  # `bos_token`, `bos_token_id`, ...
            value = special.get(token)
            setattr(self, token, value)
            setattr(self, f"{token}_id", None if value is None else backend.token_to_id(value))
        self.all_special_tokens = list(dict.fromkeys([*special.values(), *extra]))
        """The named and the extra special tokens, each once."""
        self.all_special_ids = [self._id(t) for t in self.all_special_tokens]

    def __len__(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def __call__(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> dict[str, Any]:
        """{'input_ids': ..., 'attention_mask': ...} of one text, as transformers' call gives."""
        unsupported = sorted(k for k, v in kwargs.items() if v)
        if unsupported or not isinstance(text, str):
            raise TypeError(f"DirectTokenizer encodes one text, without {', '.join(unsupported)}")
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of one text."""
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: int | Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of some ids (no clean-up of spaces: the configs read here ask for none)."""
        seq = [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]
        return str(self._tokenizer.decode(seq, skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> str | list[str | None] | None:
        """The vocabulary entry of an id (or of each id)."""
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        return [self._tokenizer.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> int | list[int | None] | None:
        """The id of a vocabulary entry (or of each), the unknown token's for one not there."""
        if isinstance(tokens, str):
            return self._id(tokens)
        return [self._id(t) for t in tokens]

    def _id(self, token: str) -> int | None:
        found = self._tokenizer.token_to_id(token)
        return self.unk_token_id if found is None and token != self.unk_token else found

    def get_vocab(self) -> dict[str, int]:
        """Every entry and its id, added tokens included."""
        return dict(self._tokenizer.get_vocab(with_added_tokens=True))

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens that are set (what chat templates are given)."""
        return dict(self._special)

    def __getattr__(self, name: str) -> Any:
        """`bos_token`, `unk_token_id` and the like, as transformers' tokenizer answers them
        (those of SPECIAL and of the tokens set are attributes already)."""
        token = name.removesuffix("_id")
        if not token.endswith("_token") or name.startswith("_"):
            raise AttributeError(name)
        value = self.__dict__["_special"].get(token)
        if value is None or token == name:
            return value
        return self._tokenizer.token_to_id(value)

    def get_chat_template(self, chat_template: str | None = None, tools: Any = None) -> str:
        """The chat template to render (by name, or the default), as transformers picks it."""
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase

        return str(PreTrainedTokenizerBase.get_chat_template(self, chat_template, tools))  # type: ignore[arg-type]

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        """transformers' `apply_chat_template`, run on this tokenizer."""
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase

        return PreTrainedTokenizerBase.apply_chat_template(self, conversation, **kwargs)  # type: ignore[arg-type]


def open_tokenizer(folder: Path, config: dict[str, Any]) -> DirectTokenizer | None:
    """The folder's tokenizer read directly, when transformers would read it into its generic
    class and add nothing to it (`config`: config.json's contents); None otherwise, and where
    the gate in `embedlens.compat.transformers` closes the shortcut."""
    if not fast("tokenizer"):
        return None
    settings = _json(folder / "tokenizer_config.json")
    path = folder / "tokenizer.json"
    if not isinstance(settings, dict) or not path.is_file() or not _generic(settings, config):
        return None
    if any(settings.get(k) for k in _CHANGES_TEXT) or "fast_tokenizer_files" in settings:
        return None
    special, extra = _special_tokens(settings)
    backend = _backend(path)
    if backend is None or special is None or extra is None:
        return None
    if not backend.get_added_tokens_decoder():
        _check_added_tokens(path)
    added = {i: _flags(t) for i, t in backend.get_added_tokens_decoder().items()}
    if not _adds_nothing(folder, settings, added, [*special.values(), *extra]):
        return None
    return DirectTokenizer(backend, special, extra, _chat_template(folder, settings), str(folder))


def _check_added_tokens(path: Path) -> None:
    """embedlens' check of tokenizer.json's top-level keys (`check_tokenizer_json`), where the
    `tokenizers` library's own reading does not settle it. A file it reads is a JSON object whose
    'model' is one and whose 'added_tokens', if there, is a list; its added tokens come from that
    list alone, so a tokenizer with one has it, and the 3.5 MB file is not parsed again in Python
    (0.05 to 0.1 s). Without one, the list may be missing: the whole check runs."""
    from embedlens.model.tokenizer import check_tokenizer_json

    check_tokenizer_json(path)


def _json(path: Path) -> Any:
    """A small JSON file's contents (None if absent or not JSON: transformers then says why)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _generic(settings: dict[str, Any], config: dict[str, Any]) -> bool:
    """Whether AutoTokenizer would build transformers' generic class for these files."""
    from transformers.models.auto import tokenization_auto as auto

    named = settings.get("tokenizer_class")
    if named not in GENERIC or "auto_map" in settings:
        return False
    model_type = config.get("model_type")
    registered = (
        auto.TOKENIZER_MAPPING_NAMES.get(model_type) if isinstance(model_type, str) else None
    )
    if registered is None or registered.removesuffix("Fast") == str(named).removesuffix("Fast"):
        return True
    registered = registered.removesuffix("Fast")
    if registered == "MistralCommonBackend":
        return False  # transformers picks it when the folder is in Mistral's own format
    wrong = auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
    # the config's class is overruled for model types whose hub configs name the wrong one
    return registered in _NOT_REBUILT or (
        model_type not in wrong and config.get("model_name") not in wrong
    )


def _flags(token: Any) -> dict[str, Any]:
    """An added token's content and settings, as tokenizer.json and tokenizer_config.json
    spell them."""
    return {name: getattr(token, name) for name in _TOKEN_FLAGS}


def _special_tokens(settings: dict[str, Any]) -> tuple[dict[str, str] | None, list[str] | None]:
    """The named special tokens (the standard ones and a model's own `*_token`s) and the extra
    ones, as text; None where transformers would read one otherwise than as a plain token."""
    special: dict[str, str] = {}
    for key, value in settings.items():
        if value is None or not key.endswith("_token"):
            continue
        text = value if isinstance(value, str) else _saved_token(value) if key in SPECIAL else None
        if text is None and (key in SPECIAL or isinstance(value, dict)):
            return None, None
        if text is not None:  # a model's own *_token that is no token (add_bos_token) is no name
            special[key] = text
    extra = settings.get("extra_special_tokens") or settings.get("additional_special_tokens") or []
    if isinstance(extra, dict):
        if not all(isinstance(v, str) for v in extra.values()):
            return None, None
        return {**special, **extra}, []
    texts = [t if isinstance(t, str) else _saved_token(t) for t in extra]
    if not isinstance(extra, list) or None in texts:
        return None, None
    return special, [t for t in texts if t is not None]


def _saved_token(value: Any) -> str | None:
    """A saved AddedToken's text (None for anything else)."""
    if isinstance(value, dict) and value.get("__type") == "AddedToken":
        content = value.get("content")
        return content if isinstance(content, str) else None
    return None


def _adds_nothing(
    folder: Path, settings: dict[str, Any], added: dict[int, dict[str, Any]], special: list[str]
) -> bool:
    """Whether transformers would leave tokenizer.json's tokens as they are: every token it lists
    again is already added with the same settings, and every special token is an added one."""
    listed = settings.get("added_tokens_decoder")
    if listed is None:
        # the legacy files would list tokens of their own; without them, tokenizer.json's own
        # added tokens are listed again
        listed = {} if not any((folder / f).exists() for f in _LEGACY_FILES) else None
    if not isinstance(listed, dict):
        return False
    for key, token in listed.items():
        if not str(key).isdigit() or not isinstance(token, dict):
            return False
        have = added.get(int(key))
        if have is None or any(token.get(f) != have.get(f) for f in _TOKEN_FLAGS):
            return False
    contents = {t.get("content") for t in added.values()}
    return all(t in contents for t in special if t)


def _backend(path: Path) -> Tokenizer | None:
    """tokenizer.json read by the `tokenizers` library (None if it cannot: transformers then
    fails on it as it always has)."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception:  # the Rust side raises a bare Exception for a malformed file
        return None


def _chat_template(folder: Path, settings: dict[str, Any]) -> Any:
    """The chat template(s) as transformers reads them: chat_template.jinja and the named ones
    in additional_chat_templates/ over tokenizer_config.json's."""
    found: dict[str, str] = {}
    default = folder / CHAT_TEMPLATE
    if default.is_file():
        found["default"] = default.read_text(encoding="utf-8")
    others = folder / CHAT_TEMPLATES
    if others.is_dir():
        for path in others.glob("*.jinja"):
            found[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if list(found) == ["default"]:
        return found["default"]
    if found:
        return found
    template = settings.get("chat_template")
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template}
    return template
