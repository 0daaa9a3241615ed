"""transformers' own reading of a GGUF file's config and tokenizer, kept in embedlens' cache.

transformers builds both from the file's metadata through gguf's reader, which parses every field
in Python on every run (seconds for a 49k-token vocabulary). What it built is kept under
`$EMBEDLENS_CACHE/gguf` (default `$HF_HOME/embedlens/gguf`), one folder per file, named by a
SHA-256 of the file's bytes before its tensor data (every metadata field and the tensor table, as
stored), the transformers, tokenizers and gguf versions and this module's format: an entry is
what this release built from those bytes, and another file or release gets another name. The
config is kept as `save_pretrained` writes it and read back with `AutoConfig`, the tokenizer
likewise with `AutoTokenizer`. A missing or unreadable entry is rebuilt, a cache that cannot be
written is left alone; `EMBEDLENS_PLAIN=1` neither reads nor writes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

from embedlens.io.gguf import GGUFHeader

FORMAT = 1
"""Raise when what is kept, or how it is read back, changes."""
_CHUNK = 1 << 20


def entry(header: GGUFHeader) -> Path | None:
    """The cache folder for this file's config and tokenizer (it may not exist yet), or None
    when the cache is not used (EMBEDLENS_PLAIN=1)."""
    if os.environ.get("EMBEDLENS_PLAIN", "").strip() not in ("", "0"):
        return None
    return _cache_dir() / _key(header)


def load_config(folder: Path | None) -> Any:
    """The kept config, or None."""
    if folder is None or not (folder / "config.json").is_file():
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder))
    except Exception:  # a damaged entry: built again
        return None


def load_tokenizer(folder: Path | None) -> Any:
    """The kept tokenizer, or None."""
    if folder is None or not (folder / "tokenizer.json").is_file():
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception:  # a damaged entry: built again
        return None


def store(folder: Path | None, built: Any, name: str) -> None:
    """Keep `built` (a config or a tokenizer, `name` its main file) in `folder` (over a damaged
    entry): written to a folder of its own, then moved into place file by file, the main file
    last, so a reader never sees half a file."""
    if folder is None:
        return
    tmp = folder.parent / f".{folder.name}.{os.getpid()}.partial"
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        built.save_pretrained(str(tmp))
        folder.mkdir(exist_ok=True)
        for path in sorted(tmp.iterdir(), key=lambda p: p.name == name):  # the main file last
            os.replace(path, folder / path.name)
    except Exception:  # a read-only or full disk
        pass
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)


def _cache_dir() -> Path:
    own = os.environ.get("EMBEDLENS_CACHE", "").strip()
    if own:
        return Path(own).expanduser() / "gguf"
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "embedlens" / "gguf"


def _key(header: GGUFHeader) -> str:
    from importlib.metadata import version

    versions = " ".join(version(name) for name in ("transformers", "tokenizers", "gguf"))
    digest = hashlib.sha256(f"embedlens-gguf {FORMAT} {versions}\0".encode())
    with open(header.path, "rb") as fh:
        left = header.data_offset
        while left > 0:
            chunk = fh.read(min(left, _CHUNK))
            if not chunk:
                break
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()
