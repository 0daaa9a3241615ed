"""Resolve what the user typed as MODEL: a local folder, a .gguf file, a hub repo id, or a GGUF
file of a hub repo (`REPO:FILE.gguf`, transformers' `gguf_file=`).

Resolution happens before anything is handed to transformers, so that each way of failing gets its
own message. Hub files are fetched one at a time (embedlens.io.hub), and only when a command asks
for them.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from embedlens.errors import SourceError
from embedlens.io.gguf import GGUF_MAGIC
from embedlens.io.hub import hub_file
from embedlens.io.hub_gguf import header_copy, split_spec

SourceKind = Literal["dir", "gguf", "hub"]

_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.\-]*/)?[A-Za-z0-9][\w.\-]*$")
WEIGHT_INDEX = "model.safetensors.index.json"
WEIGHT_SINGLE = "model.safetensors"


@dataclass(frozen=True)
class ModelSource:
    """A resolved MODEL: where its files are, or which hub repo and revision holds them."""

    spec: str
    kind: SourceKind
    path: Path | None = None
    """The local folder (dir), the .gguf file (gguf), or the cached snapshot folder (hub)."""
    repo_id: str | None = None
    revision: str | None = None
    hub_file: str | None = None
    """A GGUF file of a hub repo (`REPO:FILE.gguf`): its name in the repo."""
    remote: bool = False
    """`path` is a sparse copy of the hub GGUF holding only its header: the tensors' bytes are
    fetched by range when read (embedlens.io.hub_gguf)."""
    _missing: set[str] = field(default_factory=set, compare=False, repr=False)
    is_gguf: bool = field(init=False, compare=False, repr=False)
    """Whether the model is a single GGUF file (kind 'gguf'), set when the source is made."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "is_gguf", self.kind == "gguf")

    @property
    def folder(self) -> Path | None:
        """The folder holding the model's files, if it is on disk."""
        if self.kind == "gguf" and self.path is not None:
            return self.path.parent
        return self.path

    def file(self, name: str) -> Path:
        """Return a file of the model, fetching it from the hub if needed; SourceError if absent."""
        found = self.find(name)
        if found is None:
            where = self.repo_id if self.kind == "hub" else str(self.path)
            raise SourceError(f"'{where}' has no file '{name}'")
        return found

    def find(self, name: str) -> Path | None:
        """Return a file of the model if it exists (fetching it from the hub), else None."""
        if self.kind != "hub":
            folder = self.folder
            assert folder is not None
            candidate = folder / name
            return candidate if candidate.is_file() else None
        if name in self._missing:
            return None
        assert self.repo_id is not None
        found = hub_file(self.repo_id, name, self.revision, required=False)
        if found is None:
            self._missing.add(name)
        return found

    def cached(self, name: str) -> Path | None:
        """Return a hub file only if it is already in the local cache (never downloads)."""
        if self.kind != "hub":
            return self.find(name)
        from huggingface_hub import try_to_load_from_cache

        assert self.repo_id is not None
        hit = try_to_load_from_cache(self.repo_id, name, revision=self.revision)
        return Path(hit) if isinstance(hit, str) else None

    def whole_gguf(self) -> Path:
        """The GGUF file whole, for loading the model: a hub GGUF is downloaded into the hub
        cache (as transformers' gguf_file would)."""
        assert self.path is not None
        if not self.remote:
            return self.path
        assert self.repo_id is not None and self.hub_file is not None
        found = hub_file(self.repo_id, self.hub_file, self.revision, required=True)
        assert found is not None
        return found

    def listing(self) -> list[str] | None:
        """File names of the model's folder or snapshot, when they can be listed without network."""
        folder = self.folder
        if folder is None or not folder.is_dir():
            return None
        return sorted(p.name for p in folder.iterdir() if p.is_file())


def resolve(spec: str, revision: str | None = None) -> ModelSource:
    """Turn MODEL as typed into a ModelSource, or raise SourceError saying what was tried."""
    if not spec or not spec.strip():
        raise SourceError(
            "MODEL is empty", hint="give a hub repo id, a local folder or a .gguf file"
        )
    path = Path(spec).expanduser()
    if _stat(spec, path):
        return _local(spec, path)
    in_repo = split_spec(spec)
    if in_repo is not None and _REPO_ID.match(in_repo[0]) and ".." not in in_repo[0]:
        return _hub_gguf(spec, *in_repo, revision)
    if _looks_like_path(spec):
        raise SourceError(f"no such file or directory: '{spec}'")
    if not _REPO_ID.match(spec) or "--" in spec or ".." in spec:
        raise SourceError(
            f"'{spec}' is neither an existing path nor a hub repo id",
            hint="a repo id looks like 'namespace/name', e.g. 'Qwen/Qwen3-0.6B'; a GGUF file "
            "in a repo, 'namespace/name:file.gguf'",
        )
    config = hub_file(spec, "config.json", revision, required=False)
    if config is None:
        raise SourceError(
            f"hub repo '{spec}' has no config.json"
            + (f" at revision '{revision}'" if revision else ""),
            hint="embedlens reads Hugging Face causal LMs that ship a config.json",
        )
    return ModelSource(spec=spec, kind="hub", path=config.parent, repo_id=spec, revision=revision)


def _hub_gguf(spec: str, repo_id: str, filename: str, revision: str | None) -> ModelSource:
    """A GGUF file of a hub repo: the hub cache's copy when it holds the whole file, else a
    sparse copy holding its header, read by range."""
    from huggingface_hub import try_to_load_from_cache

    hit = try_to_load_from_cache(repo_id, filename, revision=revision)
    if isinstance(hit, str):
        path, remote = Path(hit), False
    else:
        path, remote = header_copy(repo_id, filename, revision)[0], True
    return ModelSource(
        spec=spec,
        kind="gguf",
        path=path,
        repo_id=repo_id,
        revision=revision,
        hub_file=filename,
        remote=remote,
    )


def _permission_denied(spec: str) -> SourceError:
    return SourceError(
        f"cannot read '{spec}': permission denied",
        hint="check the permissions of the model's files and of the folders above them",
    )


def _stat(spec: str, path: Path) -> bool:
    """Whether a path exists; SourceError when it cannot be looked at (no permission to a
    folder on the way, a loop of symbolic links), rather than calling it missing."""
    try:
        path.stat()
    except PermissionError as e:
        raise _permission_denied(spec) from e
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SourceError(
                f"cannot read '{spec}': its symbolic links form a loop",
                hint="point the link at the real file",
            ) from e
        return False
    return True


def _looks_like_path(spec: str) -> bool:
    if spec.startswith((".", "/", "~")) or spec.lower().endswith((".gguf", ".safetensors")):
        return True
    return spec.count("/") > 1 or (os.sep != "/" and os.sep in spec)


def _has_gguf_magic(spec: str, path: Path) -> bool:
    """Whether a file starts with GGUF's magic (a GGUF file saved under another name)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == GGUF_MAGIC
    except PermissionError as e:
        raise _permission_denied(spec) from e
    except OSError as e:
        raise SourceError(f"cannot read '{spec}': {e.strerror or e}") from e


def _local(spec: str, path: Path) -> ModelSource:
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return ModelSource(spec=spec, kind="gguf", path=path.resolve())
        if path.name == "config.json":
            return _local(spec, path.parent)
        if _has_gguf_magic(spec, path):
            return ModelSource(spec=spec, kind="gguf", path=path.resolve())
        raise SourceError(
            f"'{spec}' is a file but not a model",
            hint="give the model's folder (with config.json and weights) or a .gguf file",
        )
    if not path.is_dir():
        raise SourceError(f"'{spec}' is neither a file nor a folder")
    config = path / "config.json"
    if _stat(str(config), config):
        return ModelSource(spec=spec, kind="dir", path=path.resolve())
    if config.is_symlink():
        raise SourceError(
            f"'{config}' is a symbolic link to a missing file ('{os.readlink(config)}')"
        )
    try:
        ggufs = sorted(path.glob("*.gguf"))
    except OSError as e:
        raise SourceError(f"cannot read folder '{spec}': {e.strerror}") from e
    if len(ggufs) == 1:
        return ModelSource(spec=spec, kind="gguf", path=ggufs[0].resolve())
    try:
        names = sorted(p.name for p in path.iterdir())
    except OSError as e:
        raise SourceError(f"cannot read folder '{spec}': {e.strerror}") from e
    shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "") if names else "nothing"
    hint = "a model folder holds config.json beside its weights"
    if len(ggufs) > 1:
        hint = "several .gguf files here: name the one to read"
    raise SourceError(f"folder '{spec}' has no config.json (it holds {shown})", hint=hint)
