"""The prompt is the file's tokens: the ids a GGUF model is run on, checked against the file's
own tokenizer before the forward pass.

A GGUF file carries its tokenizer as metadata, and transformers rebuilds it; releases before the
newest tested read some files otherwise than the file says (a BOS added where
`tokenizer.ggml.add_bos_token` is false, none where it is true, pieces merged in another order),
and the lens then runs, and checks itself, on other tokens. embedlens rebuilds the same tokenizer
itself (`tokenizer.vocab_from_gguf`) and adds what the file's metadata asks: BOS when
`add_bos_token` says so (a SentencePiece vocabulary that does not say adds it, as llama.cpp and
transformers read it), EOS when `add_eos_token` does. While a run's prompts are tokenised
(`watching`), every text `analysis.lens.opening` encodes (the prompt, a chat-rendered prompt, a
--target, each line of --prompts) is encoded that way too; a difference refuses the run
(UnsupportedError) with both id lists. With --against, B's GGUF file is asked as well: B runs on
A's ids.

Every id a run feeds the model has a row in its embedding too (`Rows`): checked as each text is
tokenised, before any forward pass, and for a model read from its files before its weights are
loaded (the rows come from the headers). Before that, where a folder's tokenizer.json has an id
past the rows, the texts are read with the `tokenizers` library alone (`early`), so a tokenizer
that does not belong is refused before transformers is imported: a tokenizer with more ids than
the model has rows (SmolLM2's 49,152 beside a model of 2,048) would otherwise fail inside the
embedding's lookup; here it is one error that names both sizes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from embedlens.compat.transformers import NEWEST_TESTED as TESTED_TRANSFORMERS
from embedlens.compat.transformers import installed_transformers, release_key
from embedlens.errors import ConfigError, UnsupportedError
from embedlens.io.gguf import GGUFHeader, read_gguf_header
from embedlens.text import visible

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from embedlens.io.source import ModelSource
    from embedlens.model.files import ModelFiles
    from embedlens.model.tokenizer import Vocab

_READS_OTHERWISE = ("auto_map", "split_special_tokens", "fix_mistral_regex", "add_prefix_space")
"""tokenizer_config.json settings under which transformers' ids may not be the `tokenizers`
library's reading of tokenizer.json (code of the model's own, special tokens split as text, a
pre-tokenizer replaced or told to add a space): the early check leaves such a tokenizer to the
exact one."""


@dataclass(frozen=True)
class Rows:
    """A model's embedding rows, which every id fed to it must be below."""

    model: str
    """The model as messages name it."""
    rows: int
    tokens: int | None
    """The size of the tokenizer giving the ids (None: it does not say)."""

    def check(self, ids: Sequence[int]) -> None:
        """ConfigError when an id has no row."""
        high = max(ids, default=-1)
        if high < self.rows:
            return
        size = "" if self.tokens is None else f"has {self.tokens:,} ids and "
        raise ConfigError(
            f"the tokenizer {size}gives id {high:,}, but the embedding of '{self.model}' has "
            f"{self.rows:,} rows: the tokenizer and the model do not belong together",
            hint="use the model's own tokenizer (or a model whose embedding has a row for "
            "every id its tokenizer gives)",
        )


def tokenizer_size(tokenizer: Any) -> int | None:
    """How many ids the tokenizer has (added tokens included); None when it does not say."""
    try:
        return len(tokenizer)
    except (TypeError, ValueError):
        return None


def file_rows(files: ModelFiles) -> int | None:
    """The embedding's rows as the headers give them (None: no headers, or no embedding
    found)."""
    if files.checkpoint is None or files.embedding is None:
        return None
    entry = files.checkpoint.tensors.get(files.embedding)
    return None if entry is None or not entry.shape else int(entry.shape[0])


def of_files(
    files: ModelFiles,
    tokenizer: Any,
    name: str,
    others: tuple[ModelSource, ...] = (),
    *,
    trust_remote_code: bool = False,
) -> tuple[Rows, ...]:
    """The rows of a model read from its files, and of `others` run on the same ids (--against's
    B), each from its headers."""
    from embedlens.model.files import check_source

    size = tokenizer_size(tokenizer)
    found = [(name, file_rows(files))]
    for other in others:
        other_files = check_source(other, trust_remote_code=trust_remote_code)
        found.append((other.spec, file_rows(other_files)))
    return tuple(Rows(model, rows, size) for model, rows in found if rows is not None)


def of_loaded(model: Any, tokenizer: Any, name: str) -> tuple[Rows, ...]:
    """The rows of a model the caller loaded (its input embedding's weight)."""
    try:
        weight = model.get_input_embeddings().weight
        rows = int(weight.shape[0])
    except (AttributeError, TypeError, IndexError, NotImplementedError):
        return ()
    return (Rows(name, rows, tokenizer_size(tokenizer)),)


def early(
    files: ModelFiles,
    name: str,
    others: tuple[ModelSource, ...] = (),
    *,
    trust_remote_code: bool = False,
) -> Callable[[str], None] | None:
    """A check of one text read as it is (a prompt, a --target), before transformers is
    imported: ConfigError, as `Rows.check` gives it, when the ids tokenizer.json's own reading
    gives the text's content have one past the rows of the model's embedding or `others'`
    (--against's B). None where it cannot tell: no folder tokenizer.json that the `tokenizers`
    library reads as transformers would, no rows in the headers, or no id of the tokenizer at or
    past the rows (nothing to check).

    Only the text's own ids are checked: the special tokens a post-processor adds are
    transformers' to decide (tokenizer_config.json's add_bos_token replaces it), so the exact
    check (`file_tokens.watching`) still sees every id."""
    tok = _own_tokenizer(files, trust_remote_code=trust_remote_code)
    if tok is None:
        return None
    from embedlens.model.files import check_source

    found = [(name, file_rows(files))]
    for other in others:
        found.append(
            (other.spec, file_rows(check_source(other, trust_remote_code=trust_remote_code)))
        )
    vocab = tok.get_vocab(with_added_tokens=True)
    high = max(vocab.values(), default=-1)
    size = int(tok.get_vocab_size(with_added_tokens=True))
    rows = tuple(Rows(model, n, size) for model, n in found if n is not None and high >= n)
    if not rows:
        return None

    def check(text: str) -> None:
        ids = tok.encode(text, add_special_tokens=False).ids
        for each in rows:
            each.check(ids)

    return check


def _own_tokenizer(files: ModelFiles, *, trust_remote_code: bool) -> Tokenizer | None:
    """A model's tokenizer.json read by the `tokenizers` library, where its ids for a text are
    transformers' (None elsewhere: a GGUF file, no tokenizer.json, settings that change the
    reading, code of the model's own, a file the library cannot read)."""
    import json

    source = files.source
    if source.is_gguf or files.config_json is None:
        return None
    if trust_remote_code and "auto_map" in files.config_json:
        return None
    settings_path = source.find("tokenizer_config.json")
    settings: Any = {}
    if settings_path is not None:
        try:
            settings = json.loads(settings_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
    if not isinstance(settings, dict) or any(settings.get(k) for k in _READS_OTHERWISE):
        return None
    path = source.find("tokenizer.json")
    if path is None:
        return None
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception:  # the Rust side raises a bare Exception; transformers then says why
        return None
    tok.no_truncation()  # as transformers reads one text: neither cut nor padded
    tok.no_padding()
    return tok


CHECKED_TEXTS = 8
"""How many of a run's first texts (tune's, the lines of --text) are checked against a GGUF
file's own tokenizer: a release that converts the file's tokenizer otherwise reads ordinary text
otherwise from the first line."""
_KEEP = 2
"""GGUF vocabularies kept built in this process (a run reads one, or two with --against)."""
_KEPT: OrderedDict[tuple[str, int, int], tuple[Vocab, GGUFHeader]] = OrderedDict()
_SHOWN_IDS = 16
"""Ids shown of a longer list: those around the first difference."""
_SHOWN_CHARS = 60


def file_vocab(path: Path, header: GGUFHeader | None = None) -> Vocab:
    """The file's tokenizer as embedlens rebuilds it (`vocab_from_gguf`), built once for the
    run: the tokenizer check, the --target check and the prompt check read the same one."""
    return _read(path, header)[0]


def _read(path: Path, header: GGUFHeader | None = None) -> tuple[Vocab, GGUFHeader]:
    from embedlens.model import tokenizer

    try:
        stat = path.stat()
        key: tuple[str, int, int] | None = (str(path), stat.st_mtime_ns, stat.st_size)
    except OSError:
        key = None  # reading the file says what is wrong
    kept = None if key is None else _KEPT.get(key)
    if kept is not None:
        assert key is not None
        _KEPT.move_to_end(key)
        return kept
    header = header or read_gguf_header(path)
    read = tokenizer.vocab_from_gguf(header), header
    if key is not None:
        _KEPT[key] = read
        while len(_KEPT) > _KEEP:
            _KEPT.popitem(last=False)
    return read


@dataclass
class FileTokens:
    """How a GGUF file reads text: its own tokenizer, BOS and EOS as its metadata asks (read
    when first asked)."""

    path: Path
    name: str
    """The file as messages name it."""
    _ends: tuple[list[int], list[int]] | None = field(default=None, repr=False)

    @classmethod
    def of(cls, source: ModelSource) -> FileTokens:
        assert source.is_gguf and source.path is not None
        return cls(source.path, source.hub_file or source.path.name)

    def ids(self, text: str, add_special_tokens: bool) -> list[int]:
        """The ids of `text`, with the file's BOS and EOS when special tokens are added."""
        vocab, header = _read(self.path)
        body = vocab.encode(text)
        if not add_special_tokens:
            return body
        if self._ends is None:
            self._ends = special_ends(header)
        first, last = self._ends
        return [*first, *body, *last]


def special_ends(header: GGUFHeader) -> tuple[list[int], list[int]]:
    """The ids a GGUF file's tokenizer puts before and after a text: BOS when
    `tokenizer.ggml.add_bos_token` is true (when absent: for a SentencePiece vocabulary,
    'llama'), EOS when `add_eos_token` is."""
    add_bos = header.metadata.get("tokenizer.ggml.add_bos_token")
    if not isinstance(add_bos, bool):
        add_bos = header.metadata.get("tokenizer.ggml.model") == "llama"
    add_eos = header.metadata.get("tokenizer.ggml.add_eos_token") is True
    bos = header.metadata.get("tokenizer.ggml.bos_token_id")
    eos = header.metadata.get("tokenizer.ggml.eos_token_id")
    first = [bos] if add_bos and isinstance(bos, int) else []
    last = [eos] if add_eos and isinstance(eos, int) else []
    return first, last


@dataclass(frozen=True)
class Guard:
    """The files a run's prompt ids are checked against, and whose tokenizer gives them."""

    own: FileTokens | None
    """The model's own GGUF file (None: the model is not one)."""
    loaded: bool
    """The tokenizer is transformers' reading of `own` (else one given by the caller)."""
    others: tuple[FileTokens, ...] = ()
    """Other models' GGUF files that run on the same ids (--against's B)."""
    model: str = ""
    """The model whose tokenizer gives the ids, as messages name it."""
    rows: tuple[Rows, ...] = ()
    """The embeddings every id must have a row in (the model's, and --against's B's)."""

    def check(self, text: str, add_special_tokens: bool, ids: list[int]) -> None:
        """ConfigError when an id has no row in a model's embedding; UnsupportedError when a
        file reads `text` as other ids than `ids`."""
        for rows in self.rows:
            rows.check(ids)
        if self.own is not None:
            want = self._own_ids(self.own, text, add_special_tokens)
            if want is not None and want != ids:
                raise self._own_refusal(text, ids, want)
        for other in self.others:
            want = other.ids(text, add_special_tokens)
            if want != ids:
                raise UnsupportedError(
                    f"'{other.name}' reads {_quoted(text)} as {_compared(want, ids)}, where "
                    f"the tokenizer of '{self.model}' gives {_second(want, ids)}",
                    hint=f"lens --against runs '{other.name}' on the ids of '{self.model}': "
                    "compare models that read the prompt alike",
                )

    def _own_ids(self, own: FileTokens, text: str, add_special_tokens: bool) -> list[int] | None:
        """How the model's file reads `text`; None for a file whose kind of vocabulary embedlens
        does not rebuild, read with a tokenizer given (transformers' own reading of such a file
        is refused before: `loading.check_tokenizer_files`)."""
        try:
            return own.ids(text, add_special_tokens)
        except UnsupportedError:
            if self.loaded:
                raise
            return None

    def _own_refusal(self, text: str, got: list[int], want: list[int]) -> UnsupportedError:
        assert self.own is not None
        name, shown = self.own.name, _quoted(text)
        if not self.loaded:
            return UnsupportedError(
                f"the tokenizer given reads {shown} as {_compared(got, want)}, where '{name}' "
                f"itself reads {_second(got, want)}",
                hint="leave the tokenizer out to read the prompt as the file does",
            )
        installed = installed_transformers() or "(unknown)"
        said = (
            f"transformers {installed} reads {shown} as {_compared(got, want)}, where '{name}' "
            f"itself reads {_second(got, want)}"
        )
        if release_key(installed) == release_key(TESTED_TRANSFORMERS):
            return UnsupportedError(
                f"{said}; {installed} is the newest transformers release tested, and no release "
                "is known to read this file as it says",
                hint="report it, with the file's name: embedlens cannot tell which reading the "
                "model was trained on",
            )
        return UnsupportedError(
            f"{said}; transformers {TESTED_TRANSFORMERS}, the newest release tested, reads this "
            "file as it says",
            hint=f"pip install 'transformers=={TESTED_TRANSFORMERS}', and run again",
        )


_GUARD: ContextVar[Guard | None] = ContextVar("embedlens_file_tokens", default=None)


@contextmanager
def watching(
    source: ModelSource | None,
    *,
    loaded: bool,
    others: tuple[ModelSource, ...],
    model: str,
    rows: tuple[Rows, ...] = (),
) -> Iterator[None]:
    """Check every text encoded by `check_ids` in this block against the embeddings' `rows`
    (`Rows`) and the GGUF files of the run (`guard_for`: the model's own, `source`, and
    `others`')."""
    token = _GUARD.set(guard_for(source, loaded=loaded, others=others, model=model, rows=rows))
    try:
        yield
    finally:
        _GUARD.reset(token)


@contextmanager
def watching_files(
    files: ModelFiles,
    tokenizer: Any,
    others: tuple[ModelSource, ...],
    *,
    loaded: bool,
    model: str,
    trust_remote_code: bool = False,
) -> Iterator[None]:
    """`watching` a model read from its files: the rows of its embedding and of `others'`, from
    their headers (`of_files`)."""
    rows = of_files(files, tokenizer, model, others, trust_remote_code=trust_remote_code)
    with watching(files.source, loaded=loaded, others=others, model=model, rows=rows):
        yield


def check_ids(text: str, add_special_tokens: bool, ids: list[int]) -> None:
    """The ids a tokenizer gave `text`, checked against the files being watched (nothing to
    check outside `watching`)."""
    guard = _GUARD.get()
    if guard is not None:
        guard.check(text, add_special_tokens, ids)


def guard_for(
    source: ModelSource | None,
    *,
    loaded: bool,
    others: tuple[ModelSource, ...],
    model: str,
    rows: tuple[Rows, ...] = (),
) -> Guard | None:
    """The check of a run's prompt ids: against the embeddings' `rows`, the model's own GGUF
    file (`source`, None for a model given loaded) and `others`' (None when there is nothing to
    check)."""
    own = FileTokens.of(source) if source is not None and source.is_gguf else None
    files = tuple(FileTokens.of(s) for s in others if s.is_gguf)
    if own is None and not files and not rows:
        return None
    return Guard(own, loaded, files, model, rows)


def _first_difference(a: list[int], b: list[int]) -> int:
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


def _compared(first: list[int], second: list[int]) -> str:
    """The first list as a message shows it, around where it parts from the second."""
    return _listed(first, _first_difference(first, second))


def _second(first: list[int], second: list[int]) -> str:
    """The second list as a message shows it, and where the two part."""
    at = _first_difference(first, second)
    counts = f"{len(first)} ids against {len(second)}"
    return f"{_listed(second, at)} ({counts}, the first difference at position {at})"


def _listed(ids: list[int], at: int) -> str:
    """The ids in brackets; of a long list, those around `at` and how many are left out."""
    if len(ids) <= _SHOWN_IDS:
        return "[" + ", ".join(map(str, ids)) + "]"
    start = max(0, min(at - 4, len(ids) - _SHOWN_IDS))
    end = start + _SHOWN_IDS
    parts = [f"…{start} before" if start else "", *map(str, ids[start:end])]
    parts.append(f"{len(ids) - end} more…" if end < len(ids) else "")
    return "[" + ", ".join(p for p in parts if p) + "]"


def _quoted(text: str) -> str:
    """The text quoted, control characters escaped, cut to a few dozen characters."""
    shown = visible(text)
    if len(shown) > _SHOWN_CHARS:
        shown = shown[: _SHOWN_CHARS - 1] + "…"
    return f"'{shown}'"
