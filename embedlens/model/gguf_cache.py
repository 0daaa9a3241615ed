"""What embedlens keeps of a GGUF file in its cache: the tokenizers it rebuilds from the file's
metadata, and transformers' own reading of the file's config and tokenizer. The cache is an
optimisation only: a missing, unreadable or damaged entry is built again, a cache that cannot be
written is left alone.

Tokenizers rebuilt by embedlens (`kept_tokenizer`): rebuilding a SentencePiece vocabulary of
262,144 scored pieces (Gemma 3) takes seconds, most of them spent deriving its merges from the
scores; loading the built tokenizer back takes a fraction of that. Each one is kept under
`$EMBEDLENS_CACHE/tokenizers` (default `$HF_HOME/embedlens/tokenizers`), named by a SHA-256 of
everything it is built from: the file's `tokenizer.ggml.*` metadata as stored (arrays as their raw
bytes), the format number and the `tokenizers` version. A file whose tokenizer changes gets a new
name, so an entry never outlives what it was built from; a file that changes elsewhere (its
weights) keeps its entry, which still holds. What is derived from a tokenizer alone
(analysis.vocab.facts) is kept beside it under the same key (`store_bytes`).

transformers' reading (`kept`): transformers builds the config and tokenizer from the file's
metadata through gguf's reader, which parses every field in Python on every run (seconds for a
49k-token vocabulary). What it built is kept under `$EMBEDLENS_CACHE/gguf` (default
`$HF_HOME/embedlens/gguf`), one folder per file, named by a SHA-256 of the file's bytes before its
tensor data (every metadata field and the tensor table, as stored), the transformers, tokenizers
and gguf versions and the format: an entry is what this release built from those bytes, and
another file or release gets another name. The config is kept as `save_pretrained` writes it and
read back with `AutoConfig`, the tokenizer likewise and read back by the class that built it; each
is kept only once it reads back the same (a release whose tokenizer does not survive
`save_pretrained`, as 5.0's SmolLM2 tokenizer, keeps a marker instead and builds it every time).
`EMBEDLENS_PLAIN=1` neither reads nor writes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from embedlens.io.gguf import GGUFHeader, LazyArray
from embedlens.io.source import ModelSource
from embedlens.model.files import files_of

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TOKENIZER_FORMAT = 1
"""Raise when vocab_from_gguf builds a different tokenizer from the same metadata."""
_CHUNK = 1 << 20


def cache_folder(name: str) -> Path:
    """A folder of embedlens' cache: $EMBEDLENS_CACHE/NAME, else $HF_HOME/embedlens/NAME."""
    own = os.environ.get("EMBEDLENS_CACHE", "").strip()
    if own:
        return Path(own).expanduser() / name
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "embedlens" / name


class _Digest(Protocol):
    """What `hash_span` asks of a hashlib object (typeshed's name for it is private)."""

    def update(self, data: bytes, /) -> None: ...


def hash_span(digest: _Digest, path: Path, start: int, end: int) -> None:
    """Feed the bytes [start, end) of a file to `digest`, a chunk at a time."""
    with open(path, "rb") as fh:
        fh.seek(start)
        left = end - start
        while left > 0:
            chunk = fh.read(min(left, _CHUNK))
            if not chunk:
                break
            digest.update(chunk)
            left -= len(chunk)


def cache_dir() -> Path:
    """The folder of kept tokenizers: $EMBEDLENS_CACHE/tokenizers, else
    $HF_HOME/embedlens/tokenizers."""
    return cache_folder("tokenizers")


def tokenizer_key(header: GGUFHeader) -> str:
    """SHA-256 of the tokenizer metadata (key, type and bytes of each `tokenizer.ggml.*`
    value), the cache format and the tokenizers version."""
    import tokenizers

    digest = hashlib.sha256(
        f"embedlens-gguf-tokenizer {TOKENIZER_FORMAT} {tokenizers.__version__}".encode()
    )
    for key in sorted(k for k in header.metadata if k.startswith("tokenizer.ggml.")):
        value = header.metadata[key]
        digest.update(b"\0" + key.encode("utf-8", "surrogateescape") + b"\0")
        if isinstance(value, LazyArray):
            digest.update(f"array {value.item_type} {value.count}\0".encode())
            hash_span(digest, value.path, value.start, value.end)
        else:
            digest.update(f"{type(value).__name__} {value!r}".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def load_tokenizer(key: str) -> Tokenizer | None:
    """The kept tokenizer of this key, or None when there is none or it cannot be read."""
    path = cache_dir() / f"{key}.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception:  # a damaged entry (the Rust side raises a bare Exception): rebuild
        return None


def kept_tokenizer(header: GGUFHeader, build: Callable[[], Tokenizer]) -> Tokenizer:
    """The tokenizer of a GGUF file's metadata as kept (`load_tokenizer`), else `build()` and
    kept (`store_tokenizer`)."""
    key = tokenizer_key(header)
    tok = load_tokenizer(key)
    if tok is None:
        tok = build()
        store_tokenizer(key, tok)
    return tok


def store_tokenizer(key: str, tok: Tokenizer) -> None:
    """Keep a built tokenizer under its key: written to a temporary name, then renamed into
    place, so a reader never sees half a file; nothing happens when the cache is not writable."""
    _write(f"{key}.json", lambda path: tok.save(str(path), pretty=False))


def load_bytes(name: str) -> bytes | None:
    """What is kept under `name` beside the tokenizers (facts derived from one), or None when
    there is nothing or it cannot be read."""
    try:
        return (cache_dir() / name).read_bytes()
    except OSError:
        return None


def store_bytes(name: str, data: bytes) -> None:
    """Keep `data` under `name`, as `store_tokenizer` keeps a tokenizer."""
    _write(name, lambda path: path.write_bytes(data))


def _write(name: str, write: Callable[[Path], object]) -> None:
    folder = cache_dir()
    tmp = folder / f".{name}.{os.getpid()}.partial"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, folder / name)
    except Exception:  # a read-only or full disk (OSError, or the Rust side's bare Exception)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


# --- transformers' reading of a GGUF file's config and tokenizer

FORMAT = 1
"""Raise when what `kept` keeps, or how it is read back, changes."""
_CLASS = "embedlens-tokenizer-class.txt"
"""The kept tokenizer's class, as `module:name`."""
_NOT_KEPT = "embedlens-not-kept-"
"""A marker: this release's config or tokenizer (the name after it) reads back otherwise."""
_TEXTS = (
    "The capital of France is", " Paris\n\n  two  spaces\tand a tab", "中国的首都是北京。",
    "naïve café — 12,345.67 ✓ 🙂", "def f(x):\n    return x ** 2\n",
)  # fmt: skip


def entry(header: GGUFHeader) -> Path | None:
    """The cache folder for this file's config and tokenizer (it may not exist yet), or None
    when the cache is not used (EMBEDLENS_PLAIN=1)."""
    if os.environ.get("EMBEDLENS_PLAIN", "").strip() not in ("", "0"):
        return None
    return cache_folder("gguf") / _key(header)


def entry_of(source: ModelSource) -> Path | None:
    """`entry` of a source's GGUF file (its header as read once), or None (not a GGUF file, or
    the cache is not used)."""
    if not source.is_gguf:
        return None
    ckpt = files_of(source).checkpoint
    return None if ckpt is None or ckpt.gguf is None else entry(ckpt.gguf)


def kept(source: ModelSource, name: str, build: Callable[[], Any]) -> tuple[Any, bool]:
    """The config ('config.json') or tokenizer ('tokenizer.json') `build()` makes of a source's
    GGUF file: read back from its entry where one was kept, else built and kept (`load`,
    `store`); for another source, or without the cache, built. With it, whether the source has
    an entry (what came back stands for what transformers builds from the file)."""
    folder = entry_of(source)
    built = load(folder, name)
    if built is None:
        built = build()
        store(folder, built, name)
    return built, folder is not None


def load(folder: Path | None, name: str) -> Any:
    """The kept config ('config.json') or tokenizer ('tokenizer.json'; read back by the class that
    built it, which `AutoTokenizer` would not always pick: transformers 5.0 builds SmolLM2's as a
    CodeLlamaTokenizer), or None."""
    if folder is None or not (folder / name).is_file():
        return None
    try:
        return _read(folder, name)
    except Exception:  # a damaged entry: built again
        return None


def store(folder: Path | None, built: Any, name: str) -> None:
    """Keep `built` (a config or a tokenizer, `name` its main file) in `folder` (over a damaged
    entry), once it reads back the same (otherwise a marker says so, and it is built each time):
    written to a folder of its own, then moved into place file by file, the main file last, so a
    reader never sees half a file."""
    if folder is None or (folder / f"{_NOT_KEPT}{name}").exists():
        return
    tmp = folder.parent / f".{folder.name}.{os.getpid()}.partial"
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        built.save_pretrained(str(tmp))
        if name == "tokenizer.json":
            kind = type(built)
            (tmp / _CLASS).write_text(f"{kind.__module__}:{kind.__qualname__}\n", "utf-8")
        folder.mkdir(exist_ok=True)
        same = _same(built, _read(tmp, name), name)
        if not same:
            (folder / f"{_NOT_KEPT}{name}").write_text("it reads back otherwise\n", "utf-8")
            return
        for path in sorted(tmp.iterdir(), key=lambda p: p.name == name):  # the main file last
            os.replace(path, folder / path.name)
    except Exception:  # a read-only or full disk
        pass
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)


def _read(folder: Path, name: str) -> Any:
    if (folder / f"{_NOT_KEPT}{name}").exists():
        return None
    if name == "config.json":
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(folder))
    import importlib

    module, _, kind = (folder / _CLASS).read_text(encoding="utf-8").strip().partition(":")
    if module != "transformers" and not module.startswith("transformers."):
        return None
    return getattr(importlib.import_module(module), kind).from_pretrained(str(folder))


def _same(built: Any, back: Any, name: str) -> bool:
    """Whether what was read back behaves as what was built (the config's every field; the
    tokenizer's class, every id's token and text, its special tokens and template, and a few
    texts encoded)."""
    if back is None or type(back) is not type(built):
        return False
    if name == "config.json":
        back.name_or_path = built.name_or_path
        return bool(back.to_dict() == built.to_dict())
    ids = list(range(len(built)))
    single = [[i] for i in ids]
    texts = [*_TEXTS, "".join(str(t) for t in built.all_special_tokens)]
    return bool(
        len(back) == len(built)
        and back.convert_ids_to_tokens(ids) == built.convert_ids_to_tokens(ids)
        and back.batch_decode(single) == built.batch_decode(single)
        and back.special_tokens_map == built.special_tokens_map
        and back.all_special_ids == built.all_special_ids
        and getattr(back, "chat_template", None) == getattr(built, "chat_template", None)
        and all(
            back(t, add_special_tokens=s)["input_ids"]
            == built(t, add_special_tokens=s)["input_ids"]
            for t in texts
            for s in (True, False)
        )
    )


def _key(header: GGUFHeader) -> str:
    from importlib.metadata import version

    versions = " ".join(version(name) for name in ("transformers", "tokenizers", "gguf"))
    digest = hashlib.sha256(f"embedlens-gguf {FORMAT} {versions}\0".encode())
    hash_span(digest, header.path, 0, header.data_offset)
    return digest.hexdigest()
