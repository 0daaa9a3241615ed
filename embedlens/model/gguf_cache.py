"""transformers' own reading of a GGUF file's config and tokenizer, kept in embedlens' cache.

transformers builds both from the file's metadata through gguf's reader, which parses every field
in Python on every run (seconds for a 49k-token vocabulary). What it built is kept under
`$EMBEDLENS_CACHE/gguf` (default `$HF_HOME/embedlens/gguf`), one folder per file, named by a
SHA-256 of the file's bytes before its tensor data (every metadata field and the tensor table, as
stored), the transformers, tokenizers and gguf versions and this module's format: an entry is
what this release built from those bytes, and another file or release gets another name. The
config is kept as `save_pretrained` writes it and read back with `AutoConfig`, the tokenizer
likewise and read back by the class that built it; each is kept only once it reads back the same
(a release whose tokenizer does not survive `save_pretrained`, as 5.0's SmolLM2 tokenizer, keeps a
marker instead and builds it every time). A missing or unreadable entry is rebuilt, a cache that
cannot be written is left alone; `EMBEDLENS_PLAIN=1` neither reads nor writes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from embedlens.io.gguf import GGUFHeader
from embedlens.io.source import ModelSource
from embedlens.model.files import files_of
from embedlens.model.tokenizer_cache import cache_folder, hash_span

FORMAT = 1
"""Raise when what is kept, or how it is read back, changes."""
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
