"""The prompt as the lens runs it: its text and ids (after a chat template), the position read,
the target's id; checked against the model's context and layers before any weight is read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from embedlens.analysis.lens.options import Ask, LayerItem, resolve_layers
from embedlens.errors import ConfigError, EmbedlensError, UsageError
from embedlens.text import error_line

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class Prompt:
    """The prompt as run: its text and ids, the position read, the target's id, notes."""

    text: str
    ids: list[int]
    index: int
    target_id: int | None
    notes: list[str]
    alternative: int | None = None
    """The target's other spelling ('四' given: ' 四'), when that is one other token: the report
    says so if the model ranks it higher at the position read."""


def make_prompt(ask: Ask, tokenizer: Any, config: PretrainedConfig | None, template: str) -> Prompt:
    """Tokenise the prompt, find the target, and check both fit the model (before any weight
    is read). `template` names the model's chat template in messages."""
    own = None if ask.template is None else ask.template[0]
    name = template if ask.template is None else ask.template[1]
    text, ids = prompt_ids(tokenizer, ask.prompt, ask.chat, ask.switches, name, config, own)
    notes: list[str] = []
    target_id = alternative = None
    if ask.target is not None:
        target_id, alternative = target_token(tokenizer, ask.target)
    check_fits(config, ids, ask.layers)
    index = position_index(ask.position, len(ids))
    return Prompt(text, ids, index, target_id, notes, alternative)


def prompt_ids(
    tokenizer: Any,
    prompt: str,
    chat: str | None,
    switches: dict[str, Any],
    template: str,
    config: PretrainedConfig | None,
    chat_template: str | None = None,
) -> tuple[str, list[int]]:
    """The text run and its ids: PROMPT as the tokenizer encodes it by default, or after a chat
    template (whose output already holds the special tokens, so none are added again).

    The template (named by `template`) renders within bounds of time and size, and its text is
    checked against what the model's context could hold before it is tokenised. A
    `chat_template` (Jinja text) is used instead of the tokenizer's own.
    """
    if chat is None:
        ids = encoded(tokenizer, prompt)
        text = prompt
    else:
        context = context_length(config)
        text = _render_chat(tokenizer, chat, switches, template, context, chat_template) + prompt
        ids = encoded(tokenizer, text, add_special_tokens=False)
    if not ids:
        raise UsageError("the prompt is empty: it encodes to no tokens")
    return text, ids


def encoded(tokenizer: Any, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """The ids the tokenizer gives `text`, checked against a GGUF file's own reading while a
    run's prompts are checked (`file_tokens.watching`)."""
    from embedlens.model.file_tokens import check_ids

    asked = {} if add_special_tokens else {"add_special_tokens": False}
    ids = [int(i) for i in tokenizer(text, **asked)["input_ids"]]
    check_ids(text, add_special_tokens, ids)
    return ids


def _render_chat(
    tokenizer: Any,
    chat: str,
    switches: dict[str, Any],
    template: str,
    context: int | None,
    own: str | None = None,
) -> str:
    """The chat template (the tokenizer's, or `own`) applied to one user message, with the
    generation prompt."""
    if own is None and not getattr(tokenizer, "chat_template", None):
        raise no_chat_template()
    from embedlens.model import chat as bounded

    messages = [{"role": "user", "content": chat}]
    limit = bounded.max_chars(context)
    extra = {} if own is None else {"chat_template": own}
    try:
        text = bounded.render(
            lambda: tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **extra, **switches
            ),
            limit=limit,
            what=template,
        )
    except EmbedlensError as e:
        if own is None or isinstance(e, UsageError):
            raise
        raise UsageError(e.message, hint="fix the template given with --chat-template") from e
    except Exception as e:
        if own is not None:
            raise UsageError(f"the chat template failed: {e}") from e
        # the model's own template (raise_exception, a Jinja error): its files are at fault
        raise ConfigError(
            f"{template} fails: {error_line(e, limit=None)}",
            hint="give a working template with --chat-template FILE, or run without --chat",
        ) from e
    if len(text) > limit:
        raise UsageError(
            f"the prompt after the chat template is {len(text):,} characters, more than the "
            f"model's context could hold"
        )
    return text


def no_chat_template() -> UsageError:
    """--chat with neither the model's chat template nor --chat-template."""
    return UsageError(
        "this model's tokenizer has no chat template, so --chat cannot be used",
        hint="give one with --chat-template FILE (a Jinja file), or run without --chat "
        "and write the whole prompt yourself",
    )


def target_token(tokenizer: Any, target: str) -> tuple[int, int | None]:
    """The id of the --target token, and of its spaced form (' ' + target) when that is another
    single token (which of the two the model means is its own to say: see `target_note`)."""

    def encode(text: str) -> list[int]:
        return encoded(tokenizer, text, add_special_tokens=False)

    def text_of(token_id: int) -> str:
        return token_text(tokenizer, token_id)

    unk = getattr(tokenizer, "unk_token_id", None)
    return single_token(target, encode, text_of, unk, getattr(tokenizer, "unk_token", None))


def single_token(
    target: str,
    encode: Callable[[str], list[int]],
    text_of: Callable[[int], str],
    unk: int | None,
    unk_token: str | None,
) -> tuple[int, int | None]:
    """`target_token` with the tokenizer given as functions (the model's own tokenizer, or
    embedlens' reading of a GGUF file's, which encodes to the same ids, before the first is
    built): the id, and the spaced form's; UsageError when the target is not one token."""
    from embedlens.model.words import spaced_form

    ids = encode(target)
    if len(ids) == 1 and (ids[0] != unk or target == unk_token):
        other = encode(" " + target) if target and not target[0].isspace() else []
        return int(ids[0]), other[0] if len(other) == 1 and other != ids else None
    if len(ids) == 1:
        raise UsageError(
            f"--target '{target}' is not in the vocabulary: it encodes to the unknown token "
            f"'{unk_token}'"
        )
    if not ids:
        raise UsageError(f"--target '{target}' encodes to no token")
    pieces = ", ".join("'" + text_of(i) + "'" for i in ids)
    one = spaced_form(target, ids, encode)
    raise UsageError(
        f"--target '{target}' is not a single token: it splits into {len(ids)} ({pieces})",
        hint="give one of those tokens, or a variant that is one token (a leading space often "
        "matters)"
        if one is None
        else f"'{text_of(one)}' with its leading space is one token (id {one}): "
        f"--target '{text_of(one)}'",
    )


def target_note(
    prompt: Prompt, target: str, output: torch.Tensor | None, tok: Callable[[int], str]
) -> str | None:
    """The note when the model ranks the target's spaced form above the target itself at the
    position read (`output`: the model's own logits there); ranks by logit, equal logits in id
    order."""
    t, a = prompt.target_id, prompt.alternative
    if t is None or a is None or output is None:
        return None
    x_t, x_a = float(output[t]), float(output[a])
    if not (x_a > x_t or (x_a == x_t and a < t)):
        return None
    return (
        f"--target '{target}' is token {t}, but the model ranks '{tok(a)}' (token {a}, with its "
        f"leading space) higher at this position: to follow that, give --target '{tok(a)}'"
    )


def token_text(tokenizer: Any, token_id: int) -> str:
    """One token as text, as every command shows it (`model.tokens.token_text`)."""
    from embedlens.model import tokens

    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    decoded = tokenizer.decode([int(token_id)])
    return tokens.token_text(decoded, piece if isinstance(piece, str) else None)


def position_index(pos: int | None, n_tokens: int) -> int:
    """The position read counted from 0 (None, `all`: the last), or UsageError out of range."""
    if pos is None:
        return n_tokens - 1
    if not -n_tokens <= pos < n_tokens:
        raise UsageError(
            f"position {pos} is out of range: the prompt has {n_tokens} tokens "
            f"(positions 0..{n_tokens - 1}, or -{n_tokens}..-1)"
        )
    return pos % n_tokens


def _text_config(config: PretrainedConfig | None) -> object:
    """The language model's part of a config (the config itself when it has no parts)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def context_length(config: PretrainedConfig | None) -> int | None:
    """The model's context length in tokens, if its config gives one."""
    context = getattr(_text_config(config), "max_position_embeddings", None)
    return context if isinstance(context, int) else None


def check_fits(
    config: PretrainedConfig | None, ids: list[int], items: list[LayerItem] | None
) -> None:
    """The prompt fits the model's context, and the layers asked for exist."""
    context = context_length(config)
    if context is not None and len(ids) > context:
        raise UsageError(
            f"the prompt is {len(ids)} tokens, longer than the model's context ({context})"
        )
    n_layers = getattr(_text_config(config), "num_hidden_layers", None)
    if items is not None and isinstance(n_layers, int):
        resolve_layers(items, n_layers)
