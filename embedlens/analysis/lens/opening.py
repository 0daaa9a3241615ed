"""The model and the prompt ready for the lens, for one prompt and for many.

From files: resolve the name, check the files, build the tokenizer, read the config, check what
was asked against them (the caller's `check`: a prompt, or every line of a prompts file), and only
then load the weights. A model given already loaded is used as it is: never reloaded, moved or
re-typed, in eval mode for the run and every module's training flag restored after.

The prompt as the lens runs it (`make_prompt`): its text and ids (after a chat template), the
position read, the target's id; checked against the model's context and layers before any weight
is read.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any, TypeVar

from embedlens.analysis.lens.options import Ask, LayerItem, Load, resolve_layers
from embedlens.errors import ConfigError, EmbedlensError, UsageError
from embedlens.text import error_line

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PretrainedConfig

    from embedlens.io.source import ModelSource
    from embedlens.model.files import ModelFiles

T = TypeVar("T")
Check = Callable[[Any, Any, str], T]
"""(tokenizer, config, the chat template's name for messages) -> what was checked."""
Targets = Callable[[Callable[[str], None]], None]
"""Given a check of one --target (UsageError when it is not one token), checks many."""


@dataclass(frozen=True)
class Opened:
    """A model ready for the lens, with what the report says of how it came."""

    name: str
    model: nn.Module
    tokenizer: Any
    config: Any
    template: str
    """The model's chat template as messages name it."""
    before: list[str]
    """Notes on loading (after the prompt's own notes)."""
    after: list[str]
    """Notes on the model's code (after the run's notes)."""


def open_model(
    model: object,
    tokenizer: Any,
    loading: Load | dict[str, bool],
    check: Check[T],
    own_template: bool = False,
    target: str | None = None,
    targets: Targets | None = None,
    others: tuple[ModelSource, ...] = (),
    texts: Iterable[str] = (),
) -> AbstractContextManager[tuple[Opened, T]]:
    """The model ready for the run (loaded from its files, or as the caller loaded it), with
    what `check` returned before any weight was read; `loading`: a `Load` for a model named by
    its files, else the loading options given for a loaded one (refused). `own_template`,
    `target`, `targets` and `texts`: as `from_files` takes them; `others`: the files of other
    models run on the same ids (the ids `check` tokenises are checked against their GGUF
    tokenizers)."""
    if not isinstance(loading, Load):
        return from_loaded(model, tokenizer, loading, check, others)
    assert isinstance(model, (str, os.PathLike))
    early = (own_template, target, targets, texts)
    return from_files(os.fspath(model), loading, tokenizer, check, *early, others=others)


@contextmanager
def from_files(
    name: str,
    load: Load,
    tokenizer: Any,
    check: Check[T],
    own_template: bool = False,
    target: str | None = None,
    targets: Targets | None = None,
    texts: Iterable[str] = (),
    *,
    others: tuple[ModelSource, ...] = (),
) -> Iterator[tuple[Opened, T]]:
    """The model named `name` loaded from its files (hub, folder or GGUF), after `check`.
    What the files alone can tell is refused before a tokenizer is built: `own_template`, the run
    needs the model's chat template (--chat without --chat-template) and they hold none;
    `target`, a --target that is not one token of a GGUF file's vocabulary; `targets` is given
    the same check for the targets of many prompts; `texts` (the texts run as they are) and
    `target`, the ids a folder's tokenizer.json gives them against the embeddings' rows
    (`file_tokens.early`). Every text `check` tokenises is checked against the rows and the GGUF
    tokenizer of the model's file, if it is one, and of `others` (`file_tokens`)."""
    from embedlens.compat.transformers.gguf_patches import gguf_reads_shared
    from embedlens.io.source import resolve
    from embedlens.model import file_tokens, loading
    from embedlens.model.files import check_source

    trust = load.trust_remote_code
    with _offload_dir(load) as folder:
        source = resolve(name, load.revision)
        if tokenizer is None:
            _from_the_files(source, own_template, target, targets)
        # headers, config and the tokenizer's files, read once by embedlens, before
        # transformers is imported
        files = check_source(source, trust_remote_code=trust)
        if tokenizer is None:
            _own_tokenizer_checks(files, name, others, trust, chain(texts, [target or ""]))
        # GGUF: the file is parsed once for tokenizer, config and weights, and let go after
        with gguf_reads_shared(source):
            loaded = tokenizer is None
            tokenizer, config = loading.tokenizer_and_config(
                files, tokenizer, trust_remote_code=trust
            )
            template = template_name(source)
            with file_tokens.watching_files(
                files, tokenizer, others, loaded=loaded, model=name, trust_remote_code=trust
            ):
                checked = check(tokenizer, config, template)
            notes: list[str] = []
            model = loading.load_model(
                files,
                dtype=load.dtype,
                device=load.device,
                device_map=load.device_map,
                max_memory=load.max_memory,
                offload_folder=folder,
                trust_remote_code=trust,
                config=config,
                notes=notes,
            )
        after = [] if files.code_note is None else [files.code_note]
        yield Opened(name, model, tokenizer, config, template, notes, after), checked


@contextmanager
def _offload_dir(load: Load) -> Iterator[str | None]:
    """The offload folder for --device-map: the user's, or a temporary one removed after."""
    folder = load.offload_folder
    if load.device_map is None or folder is not None:
        yield None if folder is None else str(folder)
        return
    tmp = tempfile.mkdtemp(prefix="embedlens-offload-")
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _from_the_files(
    source: ModelSource, own_template: bool, target: str | None, targets: Targets | None
) -> None:
    """What `from_files` refuses from the files before a tokenizer is built (see there)."""
    from embedlens.model.chat import stored_template

    if own_template and stored_template(source) is False:
        raise no_chat_template()
    if (target is not None or targets is not None) and source.is_gguf:
        one = _target_check(source)
        if target is not None:
            one(target)
        if targets is not None:
            targets(one)


def _own_tokenizer_checks(
    files: ModelFiles, name: str, others: tuple[ModelSource, ...], trust: bool, texts: Iterable[str]
) -> None:
    """What the model's own tokenizer files tell before transformers reads them: a GGUF file's
    tokenizer arrays, and the ids a folder's tokenizer.json gives `texts` against the
    embeddings' rows, where it can tell (`file_tokens.early`)."""
    from embedlens.model import file_tokens, loading

    if files.source.is_gguf:
        loading.check_tokenizer_files(files)
        return
    check = file_tokens.early(files, name, others, trust_remote_code=trust)
    if check is not None:
        for text in texts:
            if text:
                check(text)


def _target_check(source: ModelSource) -> Callable[[str], None]:
    """A --target check with embedlens' own reading of a GGUF file's tokenizer (built from the
    header, kept in the tokenizer cache), which encodes to the ids of the one transformers builds
    (tests/test_tokenizer_cache.py): a target that is not one token is refused before that."""
    from embedlens.model.file_tokens import file_vocab

    assert source.path is not None
    built = functools.cache(functools.partial(file_vocab, source.path))

    def check(target: str) -> None:  # the tokenizer is built for the first target asked about
        vocab = built()
        unk = vocab.unk_id
        unk_token = None if unk is None else vocab.piece(unk)
        single_token(target, vocab.encode, vocab.text, unk, unk_token)

    return check


@contextmanager
def from_loaded(
    model: object,
    tokenizer: Any,
    given: dict[str, bool],
    check: Check[T],
    others: tuple[ModelSource, ...] = (),
) -> Iterator[tuple[Opened, T]]:
    """A model the caller loaded, after `check`; `given` names the loading options the caller
    set (refused: a loaded model runs as it is); `others` as `from_files` takes them."""
    from embedlens.model import file_tokens
    from embedlens.model.loaded import check_loaded, loaded_name

    built = check_loaded(model, **given)
    if tokenizer is None:
        raise UsageError(
            "a loaded model needs its tokenizer to read the prompt",
            hint="pass tokenizer=, e.g. AutoTokenizer.from_pretrained(...) of the same model",
        )
    name = loaded_name(built)
    config = getattr(built, "config", None)
    template = f"the chat template of '{name}'"
    rows = file_tokens.of_loaded(built, tokenizer, name)
    with file_tokens.watching(None, loaded=False, others=others, model=name, rows=rows):
        checked = check(tokenizer, config, template)
    with _eval_mode(built):
        yield Opened(name, built, tokenizer, config, template, [], []), checked


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout) for the run; every module's training flag as it was after."""
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in flags:
            module.training = training


def template_name(source: ModelSource) -> str:
    """Which file the model's chat template comes from, for messages."""
    if source.is_gguf:
        return f"the chat template in '{source.path}'"
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        found = source.cached(name)
        if found is not None:
            return f"the chat template in '{found}'"
    return f"the chat template of '{source.spec}'"


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
    is read). The text run is the prompt as the tokenizer encodes it by default, or after the
    chat template (the caller's, else the model's, named by `template` in messages; rendered
    within bounds of time and size, and its text checked against what the model's context
    could hold before it is tokenised), whose output already holds the special tokens, so
    none are added again."""
    if ask.chat is None:
        text, ids = ask.prompt, encoded(tokenizer, ask.prompt)
    else:
        own, name = (None, template) if ask.template is None else ask.template
        context = context_length(config)
        text = _render_chat(tokenizer, ask.chat, ask.switches, name, context, own) + ask.prompt
        ids = encoded(tokenizer, text, add_special_tokens=False)
    if not ids:
        raise UsageError("the prompt is empty: it encodes to no tokens")
    target_id = alternative = None
    if ask.target is not None:
        target_id, alternative = target_token(tokenizer, ask.target)
    check_fits(config, ids, ask.layers)
    return Prompt(text, ids, position_index(ask.position, len(ids)), target_id, [], alternative)


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
    from embedlens.model.tokens import id_text

    encode = functools.partial(encoded, tokenizer, add_special_tokens=False)
    text_of = functools.partial(id_text, tokenizer)
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
