"""One way to get a model ready for the lens, for one prompt and for many.

From files: resolve the name, check the files, build the tokenizer, read the config, check what
was asked against them (the caller's `check`: a prompt, or every line of a prompts file), and only
then load the weights. A model given already loaded is used as it is: never reloaded, moved or
re-typed, in eval mode for the run and every module's training flag restored after.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any, TypeVar

from embedlens.analysis.lens.options import Load
from embedlens.errors import UsageError

if TYPE_CHECKING:
    from torch import nn

    from embedlens.io.source import ModelSource
    from embedlens.model.files import ModelFiles
    from embedlens.model.tokenizer import Vocab

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


@contextmanager
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
) -> Iterator[tuple[Opened, T]]:
    """The model ready for the run (loaded from its files, or as the caller loaded it), with
    what `check` returned before any weight was read; `loading`: a `Load` for a model named by
    its files, else the loading options given for a loaded one (refused). `own_template`,
    `target`, `targets` and `texts`: as `from_files` takes them; `others`: the files of other
    models run on the same ids (the ids `check` tokenises are checked against their GGUF
    tokenizers)."""
    if isinstance(loading, Load):
        assert isinstance(model, (str, os.PathLike))
        name = os.fspath(model)
        with from_files(
            name,
            loading,
            tokenizer,
            check,
            own_template=own_template,
            target=target,
            targets=targets,
            others=others,
            texts=texts,
        ) as opened:
            yield opened
    else:
        with from_loaded(model, tokenizer, loading, check, others) as opened:
            yield opened


@contextmanager
def from_files(
    name: str,
    load: Load,
    tokenizer: Any,
    check: Check[T],
    *,
    own_template: bool = False,
    target: str | None = None,
    targets: Targets | None = None,
    others: tuple[ModelSource, ...] = (),
    texts: Iterable[str] = (),
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
            template = _template_name(source)
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
    from embedlens.analysis.lens.prompt import no_chat_template
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
    from embedlens.analysis.lens.prompt import single_token
    from embedlens.model.file_tokens import file_vocab

    assert source.path is not None
    path = source.path
    built: list[Vocab] = []

    def check(target: str) -> None:  # the tokenizer is built for the first target asked about
        if not built:
            built.append(file_vocab(path))
        vocab = built[0]
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


def _template_name(source: ModelSource) -> str:
    """Which file the model's chat template comes from, for messages."""
    if source.is_gguf:
        return f"the chat template in '{source.path}'"
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        found = source.cached(name)
        if found is not None:
            return f"the chat template in '{found}'"
    return f"the chat template of '{source.spec}'"
