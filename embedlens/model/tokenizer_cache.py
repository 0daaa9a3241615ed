"""Tokenizers rebuilt from GGUF metadata, kept as tokenizer.json files in embedlens' cache.

Rebuilding a SentencePiece vocabulary of 262,144 scored pieces (Gemma 3) takes seconds, most of
them spent deriving its merges from the scores; loading the built tokenizer back takes a fraction
of that. Each one is kept under `$EMBEDLENS_CACHE/tokenizers` (default
`$HF_HOME/embedlens/tokenizers`), named by a SHA-256 of everything it is built from: the file's
`tokenizer.ggml.*` metadata as stored (arrays as their raw bytes), this module's format number and
the `tokenizers` version. A file whose tokenizer changes gets a new name, so an entry never
outlives what it was built from; a file that changes elsewhere (its weights) keeps its entry,
which still holds. The cache is an optimisation only: a missing, unreadable or damaged entry means
the tokenizer is rebuilt, and a cache that cannot be written is left alone. What is derived from a
tokenizer alone (analysis.vocab.facts) is kept beside it under the same key (`store_bytes`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from embedlens.io.gguf import GGUFHeader, LazyArray

if TYPE_CHECKING:
    from tokenizers import Tokenizer

FORMAT = 1
"""Raise when vocab_from_gguf builds a different tokenizer from the same metadata."""
_CHUNK = 1 << 20


def cache_dir() -> Path:
    """The folder of kept tokenizers: $EMBEDLENS_CACHE/tokenizers, else
    $HF_HOME/embedlens/tokenizers."""
    return cache_folder("tokenizers")


def cache_folder(name: str) -> Path:
    """A folder of embedlens' cache: $EMBEDLENS_CACHE/NAME, else $HF_HOME/embedlens/NAME."""
    own = os.environ.get("EMBEDLENS_CACHE", "").strip()
    if own:
        return Path(own).expanduser() / name
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "embedlens" / name


def tokenizer_key(header: GGUFHeader) -> str:
    """SHA-256 of the tokenizer metadata (key, type and bytes of each `tokenizer.ggml.*`
    value), the cache format and the tokenizers version."""
    import tokenizers

    digest = hashlib.sha256(f"embedlens-gguf-tokenizer {FORMAT} {tokenizers.__version__}".encode())
    for key in sorted(k for k in header.metadata if k.startswith("tokenizer.ggml.")):
        value = header.metadata[key]
        digest.update(b"\0" + key.encode("utf-8", "surrogateescape") + b"\0")
        if isinstance(value, LazyArray):
            digest.update(f"array {value.item_type} {value.count}\0".encode())
            hash_span(digest, value.path, value.start, value.end)
        else:
            digest.update(f"{type(value).__name__} {value!r}".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


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


def load(key: str) -> Tokenizer | None:
    """The kept tokenizer of this key, or None when there is none or it cannot be read."""
    path = cache_dir() / f"{key}.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception:  # a damaged entry (the Rust side raises a bare Exception): rebuild
        return None


def kept(header: GGUFHeader, build: Callable[[], Tokenizer]) -> Tokenizer:
    """The tokenizer of a GGUF file's metadata as kept (`load`), else `build()` and kept
    (`store`)."""
    key = tokenizer_key(header)
    tok = load(key)
    if tok is None:
        tok = build()
        store(key, tok)
    return tok


def store(key: str, tok: Tokenizer) -> None:
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
    """Keep `data` under `name`, as `store` keeps a tokenizer."""
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
