"""Resolve what the user typed as MODEL: a local folder, a .gguf file, or a hub repo id.

Resolution happens before anything is handed to transformers, so that each way of failing gets its
own message. Hub files are fetched one at a time, and only when a command asks for them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from embedlens.errors import SourceError

SourceKind = Literal["dir", "gguf", "hub"]

_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.\-]*/)?[A-Za-z0-9][\w.\-]*$")
WEIGHT_INDEX = "model.safetensors.index.json"
WEIGHT_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"


@dataclass(frozen=True)
class ModelSource:
    """A resolved MODEL: where its files are, or which hub repo and revision holds them."""

    spec: str
    kind: SourceKind
    path: Path | None = None
    """The local folder (dir), the .gguf file (gguf), or the cached snapshot folder (hub)."""
    repo_id: str | None = None
    revision: str | None = None
    _missing: set[str] = field(default_factory=set, compare=False, repr=False)

    @property
    def is_gguf(self) -> bool:
        """Whether the model is a single GGUF file."""
        return self.kind == "gguf"

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
        found = _hub_file(self.repo_id, name, self.revision, required=False)
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
    if path.exists():
        return _local(spec, path)
    if _looks_like_path(spec):
        raise SourceError(f"no such file or directory: '{spec}'")
    if not _REPO_ID.match(spec) or "--" in spec or ".." in spec:
        raise SourceError(
            f"'{spec}' is neither an existing path nor a hub repo id",
            hint="a repo id looks like 'namespace/name', e.g. 'Qwen/Qwen3-0.6B'",
        )
    config = _hub_file(spec, "config.json", revision, required=False)
    if config is None:
        raise SourceError(
            f"hub repo '{spec}' has no config.json"
            + (f" at revision '{revision}'" if revision else ""),
            hint="embedlens reads Hugging Face causal LMs that ship a config.json",
        )
    return ModelSource(spec=spec, kind="hub", path=config.parent, repo_id=spec, revision=revision)


def _looks_like_path(spec: str) -> bool:
    if spec.startswith((".", "/", "~")) or spec.lower().endswith((".gguf", ".safetensors")):
        return True
    return spec.count("/") > 1 or (os.sep != "/" and os.sep in spec)


def _local(spec: str, path: Path) -> ModelSource:
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return ModelSource(spec=spec, kind="gguf", path=path.resolve())
        if path.name == "config.json":
            return _local(spec, path.parent)
        raise SourceError(
            f"'{spec}' is a file but not a model",
            hint="give the model's folder (with config.json and weights) or a .gguf file",
        )
    if not path.is_dir():
        raise SourceError(f"'{spec}' is neither a file nor a folder")
    if (path / "config.json").is_file():
        return ModelSource(spec=spec, kind="dir", path=path.resolve())
    ggufs = sorted(path.glob("*.gguf"))
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


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) asks for no network."""
    return any(
        os.environ.get(v, "").strip().lower() in {"1", "on", "yes", "true"}
        for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _hub_file(repo_id: str, filename: str, revision: str | None, *, required: bool) -> Path | None:
    """Fetch one file of a hub repo through the huggingface_hub cache, with clear errors."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision '{revision}'" if revision else ""
    try:
        return Path(hf_hub_download(repo_id, filename, revision=revision))
    except GatedRepoError as e:
        raise SourceError(
            f"'{repo_id}' is a gated repository and no token with access to it was found",
            hint="accept its terms on the hub, then set HF_TOKEN or run 'hf auth login'",
        ) from e
    except RepositoryNotFoundError as e:
        raise SourceError(
            f"hub repository '{repo_id}' was not found (or it is private)",
            hint="check the spelling; for a private repo set HF_TOKEN",
        ) from e
    except RevisionNotFoundError as e:
        raise SourceError(f"revision '{revision}' was not found in '{repo_id}'") from e
    except LocalEntryNotFoundError as e:
        if filename != "config.json" and not required:
            return None
        if hub_offline():
            raise SourceError(
                f"'{repo_id}'{at} is not in the local hub cache ({filename}) and HF_HUB_OFFLINE is set",
                hint="unset HF_HUB_OFFLINE to download it, or give a local folder",
            ) from e
        raise SourceError(
            f"'{repo_id}'{at} is not in the local hub cache and the hub could not be reached",
            hint="check the network, or give a local folder",
        ) from e
    except EntryNotFoundError as e:
        if not required:
            return None
        raise SourceError(f"'{repo_id}'{at} has no file '{filename}'") from e
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        raise SourceError(
            f"the hub answered {status or 'an error'} for '{repo_id}/{filename}'",
            hint="try again later, or give a local folder",
        ) from e
    except OSError as e:
        raise SourceError(f"could not fetch '{repo_id}/{filename}': {e}") from e
