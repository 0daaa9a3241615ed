"""Resolve what the user typed as MODEL: a local folder, a .gguf file, or a hub repo id.

Resolution happens before anything is handed to transformers, so that each way of failing gets its
own message. Hub files are fetched one at a time, and only when a command asks for them.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from embedlens.errors import SourceError
from embedlens.text import debug_enabled

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
    _missing: set[str] = field(default_factory=set, compare=False, repr=False)
    _checked: set[bool] = field(default_factory=set, compare=False, repr=False)
    """Whether loading.check_source passed, by its trust_remote_code."""

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
    if _stat(spec, path):
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


def _stat(spec: str, path: Path) -> bool:
    """Whether a path exists; SourceError when it cannot be looked at (no permission to a
    folder on the way, a loop of symbolic links), rather than calling it missing."""
    try:
        path.stat()
    except PermissionError as e:
        raise SourceError(
            f"cannot read '{spec}': permission denied",
            hint="check the permissions of the model's files and of the folders above them",
        ) from e
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


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) asks for no network."""
    return any(
        os.environ.get(v, "").strip().lower() in {"1", "on", "yes", "true"}
        for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def quiet_hub() -> None:
    """Silence huggingface_hub's retry warnings and progress bars: stderr keeps one error line.

    With --debug (EMBEDLENS_DEBUG=1) its warnings are left on.
    """
    from huggingface_hub.utils import disable_progress_bars
    from huggingface_hub.utils import logging as hub_logging

    if not debug_enabled():
        hub_logging.set_verbosity_error()
    disable_progress_bars()


def _hub_file(repo_id: str, filename: str, revision: str | None, *, required: bool) -> Path | None:
    """Fetch one file of a hub repo through the huggingface_hub cache, with clear errors."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    quiet_hub()
    try:
        return Path(hf_hub_download(repo_id, filename, revision=revision))
    except LocalEntryNotFoundError as e:
        # Offline (no cause): a file that is not cached counts as absent unless it is needed.
        if _cause(e) is None and filename != "config.json" and not required:
            return None
        raise hub_error(e, repo_id, filename, revision) or e from e
    except EntryNotFoundError as e:
        if not required:
            return None
        at = f" at revision '{revision}'" if revision else ""
        raise SourceError(f"'{repo_id}'{at} has no file '{filename}'") from e
    except Exception as e:
        error = hub_error(e, repo_id, filename, revision)
        if error is None:
            raise
        raise error from e


def hub_file_exists(repo_id: str, filename: str, revision: str | None) -> bool:
    """Whether a hub repo has a file, asked with a HEAD request (nothing downloaded)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import EntryNotFoundError

    quiet_hub()
    try:
        get_hf_file_metadata(hf_hub_url(repo_id, filename, revision=revision))
    except EntryNotFoundError:
        return False
    except Exception as e:
        error = hub_error(e, repo_id, filename, revision)
        if error is None:
            raise
        raise error from e
    return True


def _http_errors() -> tuple[type[BaseException], type[BaseException], type[BaseException]]:
    """(connect, timeout, transport) error classes of the HTTP client huggingface_hub uses."""
    try:
        import httpx2 as http  # huggingface_hub >= 2
    except ImportError:  # pragma: no cover - huggingface_hub 1.x
        import httpx as http  # type: ignore[no-redef,import-not-found,unused-ignore]
    return http.ConnectError, http.TimeoutException, http.TransportError


def _cause(e: BaseException) -> BaseException | None:
    """The network failure behind a LocalEntryNotFoundError; None when offline mode was the cause."""
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    cause = e.__cause__
    for _ in range(10):
        if cause is None or isinstance(cause, OfflineModeIsEnabled):
            return None
        if not isinstance(cause, LocalEntryNotFoundError):
            return cause
        cause = cause.__cause__
    return None


def hub_error(
    e: BaseException, repo_id: str, filename: str, revision: str | None
) -> SourceError | None:
    """The embedlens error for a huggingface_hub failure; None for one it does not know.

    filename "" stands for files the caller does not know by name (transformers fetched them).
    """
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        FileMetadataError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    connect, timeout, transport = _http_errors()
    at = f" at revision '{revision}'" if revision else ""
    where = f"'{repo_id}/{filename}'" if filename else f"'{repo_id}'"
    which = f" ({filename})" if filename else ""
    endpoint = constants.ENDPOINT
    offline = SourceError(
        f"'{repo_id}'{at} is not in the local hub cache{which} and HF_HUB_OFFLINE is set",
        hint="unset HF_HUB_OFFLINE to download it, or give a local folder",
    )
    if isinstance(e, LocalEntryNotFoundError):
        cause = _cause(e)
        if cause is None:
            if hub_offline():
                return offline
            return SourceError(f"'{repo_id}'{at} is not in the local hub cache{which}")
        return hub_error(cause, repo_id, filename, revision) or SourceError(
            f"'{repo_id}'{at} is not in the local hub cache and the hub could not be reached "
            f"({type(cause).__name__})",
            hint="check the network, or give a local folder",
        )
    if isinstance(e, OfflineModeIsEnabled):
        return offline
    if isinstance(e, GatedRepoError):
        return SourceError(
            f"'{repo_id}' is a gated repository and no token with access to it was found",
            hint="accept its terms on the hub, then set HF_TOKEN or run 'hf auth login'",
        )
    if isinstance(e, RepositoryNotFoundError):
        return SourceError(
            f"hub repository '{repo_id}' was not found (or it is private)",
            hint="check the spelling; for a private repo set HF_TOKEN",
        )
    if isinstance(e, RevisionNotFoundError):
        return SourceError(
            f"revision '{revision}' was not found in '{repo_id}'",
            hint="give a branch, a tag or a commit hash of the repository",
        )
    if isinstance(e, HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", None)
        if isinstance(status, int) and status >= 500:
            return SourceError(
                f"the hub at {endpoint} answered {status} (a server error) for {where}{at}",
                hint="the hub is failing or down: try again later, or give a local folder",
            )
        if status == 429:
            return SourceError(
                f"the hub at {endpoint} refused more requests for now (429) for '{repo_id}'",
                hint="wait a minute and retry; requests with HF_TOKEN get a higher limit",
            )
        if status in (401, 403):
            return SourceError(
                f"the hub at {endpoint} refused access ({status}) to {where}",
                hint="check that HF_TOKEN holds a token with read access to this repository",
            )
        return SourceError(
            f"the hub at {endpoint} answered {status or 'an error'} for {where}{at}",
            hint="try again later, or give a local folder",
        )
    if isinstance(e, connect):
        return SourceError(
            f"could not connect to the hub at {endpoint} to fetch {where}",
            hint="check the network (and HF_ENDPOINT, if set); with HF_HUB_OFFLINE=1 only the "
            "local hub cache is read",
        )
    if isinstance(e, timeout):
        return SourceError(
            f"the hub at {endpoint} did not answer in time for {where}",
            hint="try again later; HF_HUB_ETAG_TIMEOUT and HF_HUB_DOWNLOAD_TIMEOUT set the limits",
        )
    if isinstance(e, FileMetadataError):
        return SourceError(
            f"{endpoint} does not answer as a Hugging Face hub does (for {where})",
            hint="check HF_ENDPOINT, your proxy and your certificates",
        )
    if isinstance(e, transport) or (isinstance(e, OSError) and "Consistency check" in str(e)):
        return SourceError(
            f"the download of {where} was cut off before the end",
            hint="run the command again; the partial file was not kept in the hub cache",
        )
    if isinstance(e, OSError):
        return SourceError(f"could not fetch {where}: {e.strerror or e}")
    return None
