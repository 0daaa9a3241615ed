"""The Hugging Face hub: fetching single files, offline mode, and what each hub failure means.

huggingface_hub is imported on first use only. Its failures become SourceError through one ordered
table of cases (`_cases`): the first case that matches a failure gives its message.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from embedlens.errors import SourceError
from embedlens.text import debug_enabled


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) asks for no network."""
    return any(
        os.environ.get(v, "").strip().lower() in {"1", "on", "yes", "true"}
        for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def quiet_hub() -> None:
    """Silence huggingface_hub's retry warnings and progress bars: stderr keeps one error line.

    With --debug (EMBEDLENS_DEBUG=1) its warnings are left on. In a library call both are put
    back when the call ends (`embedlens.guest`).
    """
    from huggingface_hub.utils import disable_progress_bars
    from huggingface_hub.utils import logging as hub_logging

    from embedlens.guest import quietly_kept

    quietly_kept()
    if not debug_enabled():
        hub_logging.set_verbosity_error()
    disable_progress_bars()


def hub_file(repo_id: str, filename: str, revision: str | None, *, required: bool) -> Path | None:
    """Fetch one file of a hub repo through the huggingface_hub cache, with clear errors.

    A file the repo lacks (or, offline, one not cached) is None unless it is required.
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    quiet_hub()
    try:
        _reachable_unless_cached(repo_id, filename, revision)
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


PROBE_SECONDS = 4.0
"""How long a file not in the cache waits for the hub to answer at all: huggingface_hub retries
a failed connection five times over 23 s before it says so, while a refused connection, a name
that does not resolve (offline) or no answer in this time is told at once."""


def _reachable_unless_cached(repo_id: str, filename: str, revision: str | None) -> None:
    """Raise the hub's connection error at once where the file is not cached (where it is,
    huggingface_hub falls back to the cache without retrying): one request to the endpoint,
    through huggingface_hub's own client (its proxies and headers), once per process."""
    from huggingface_hub import constants, try_to_load_from_cache

    if hub_offline() or try_to_load_from_cache(repo_id, filename, revision=revision) is not None:
        return
    failure = _probe(str(constants.ENDPOINT))
    if failure is not None:
        raise failure


@cache
def _probe(endpoint: str) -> BaseException | None:
    """What connecting to the endpoint raised (a connection, timeout or transport error); None
    when it answered anything at all."""
    from huggingface_hub.utils import get_session

    connect, timeout, transport = http_errors()
    try:
        get_session().head(endpoint, timeout=PROBE_SECONDS, follow_redirects=False)
    except (connect, timeout, transport) as e:
        return e
    return None


def hub_error(
    e: BaseException, repo_id: str, filename: str, revision: str | None
) -> SourceError | None:
    """The embedlens error for a huggingface_hub failure; None for one it does not know.

    filename "" stands for files the caller does not know by name (transformers fetched them).
    """
    failure = _Failure(e, repo_id, filename, revision)
    for match, build in _cases():
        if isinstance(e, match) if isinstance(match, type) else match(e):
            return build(failure)
    return None


@dataclass(frozen=True)
class _Failure:
    """A hub failure and the fetch it broke, with the phrases its messages are made of."""

    error: BaseException
    repo_id: str
    filename: str
    revision: str | None

    @property
    def at(self) -> str:
        """' at revision ...' when a revision was asked for."""
        return f" at revision '{self.revision}'" if self.revision else ""

    @property
    def where(self) -> str:
        """The repo file (or the repo, when the file is not known by name), quoted."""
        return f"'{self.repo_id}/{self.filename}'" if self.filename else f"'{self.repo_id}'"

    @property
    def which(self) -> str:
        """' (file)' when the file is known by name."""
        return f" ({self.filename})" if self.filename else ""

    @property
    def endpoint(self) -> str:
        """The hub huggingface_hub talks to (HF_ENDPOINT)."""
        from huggingface_hub import constants

        return str(constants.ENDPOINT)

    @property
    def status(self) -> object:
        """The HTTP status of the hub's answer, when there was one."""
        return _status(self.error)


def _status(e: BaseException) -> object:
    """The HTTP status of the answer behind a hub error, when there was one."""
    return getattr(getattr(e, "response", None), "status_code", None)


_Match = type[BaseException] | Callable[[BaseException], bool]
_Case = tuple[_Match, Callable[[_Failure], SourceError]]


@cache
def _cases() -> tuple[_Case, ...]:
    """Hub failures in the order they are told apart: (exception class or test, message)."""
    from huggingface_hub.errors import (
        FileMetadataError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    connect, timeout, transport = http_errors()

    def http(test: Callable[[object], bool]) -> Callable[[BaseException], bool]:
        """A hub HTTP error whose status passes test."""
        return lambda e: isinstance(e, HfHubHTTPError) and test(_status(e))

    return (
        (LocalEntryNotFoundError, _not_cached),
        (OfflineModeIsEnabled, _offline),
        (GatedRepoError, _gated),
        (RepositoryNotFoundError, _repo_not_found),
        (RevisionNotFoundError, _revision_not_found),
        (http(lambda s: isinstance(s, int) and s >= 500), _server_error),
        (http(lambda s: s == 429), _rate_limited),
        (http(lambda s: s in (401, 403)), _refused),
        (HfHubHTTPError, _http_error),
        (lambda e: isinstance(e, connect) or closed_client(e), _no_connection),
        (timeout, _timed_out),
        (FileMetadataError, _not_a_hub),
        (lambda e: isinstance(e, transport) or _inconsistent(e), _cut_off),
        (OSError, _os_error),
    )


def closed_client(e: BaseException) -> bool:
    """huggingface_hub 1.x closing its HTTP client on a connection error and retrying on the
    closed client: the error of the retry (httpx's RuntimeError) stands for the connection's."""
    return isinstance(e, RuntimeError) and "client has been closed" in str(e)


def _inconsistent(e: BaseException) -> bool:
    """huggingface_hub's check that a download has the size the hub announced failed."""
    return isinstance(e, OSError) and "Consistency check" in str(e)


def _offline(f: _Failure) -> SourceError:
    return SourceError(
        f"'{f.repo_id}'{f.at} is not in the local hub cache{f.which} and HF_HUB_OFFLINE is set",
        hint="unset HF_HUB_OFFLINE to download it, or give a local folder",
    )


def _not_cached(f: _Failure) -> SourceError:
    cause = _cause(f.error)
    if cause is None:
        if hub_offline():
            return _offline(f)
        return SourceError(f"'{f.repo_id}'{f.at} is not in the local hub cache{f.which}")
    return hub_error(cause, f.repo_id, f.filename, f.revision) or SourceError(
        f"'{f.repo_id}'{f.at} is not in the local hub cache and the hub could not be reached "
        f"({type(cause).__name__})",
        hint="check the network, or give a local folder",
    )


def _gated(f: _Failure) -> SourceError:
    return SourceError(
        f"'{f.repo_id}' is a gated repository and no token with access to it was found",
        hint="accept its terms on the hub, then set HF_TOKEN or run 'hf auth login'",
    )


def _repo_not_found(f: _Failure) -> SourceError:
    return SourceError(
        f"hub repository '{f.repo_id}' was not found (or it is private)",
        hint="check the spelling; for a private repo set HF_TOKEN",
    )


def _revision_not_found(f: _Failure) -> SourceError:
    return SourceError(
        f"revision '{f.revision}' was not found in '{f.repo_id}'",
        hint="give a branch, a tag or a commit hash of the repository",
    )


def _server_error(f: _Failure) -> SourceError:
    return SourceError(
        f"the hub at {f.endpoint} answered {f.status} (a server error) for {f.where}{f.at}",
        hint="the hub is failing or down: try again later, or give a local folder",
    )


def _rate_limited(f: _Failure) -> SourceError:
    return SourceError(
        f"the hub at {f.endpoint} refused more requests for now (429) for '{f.repo_id}'",
        hint="wait a minute and retry; requests with HF_TOKEN get a higher limit",
    )


def _refused(f: _Failure) -> SourceError:
    return SourceError(
        f"the hub at {f.endpoint} refused access ({f.status}) to {f.where}",
        hint="check that HF_TOKEN holds a token with read access to this repository",
    )


def _http_error(f: _Failure) -> SourceError:
    return SourceError(
        f"the hub at {f.endpoint} answered {f.status or 'an error'} for {f.where}{f.at}",
        hint="try again later, or give a local folder",
    )


def _no_connection(f: _Failure) -> SourceError:
    return SourceError(
        f"could not connect to the hub at {f.endpoint} to fetch {f.where}",
        hint="check the network (and HF_ENDPOINT, if set); with HF_HUB_OFFLINE=1 only the "
        "local hub cache is read",
    )


def _timed_out(f: _Failure) -> SourceError:
    return SourceError(
        f"the hub at {f.endpoint} did not answer in time for {f.where}",
        hint="try again later; HF_HUB_ETAG_TIMEOUT and HF_HUB_DOWNLOAD_TIMEOUT set the limits",
    )


def _not_a_hub(f: _Failure) -> SourceError:
    return SourceError(
        f"{f.endpoint} does not answer as a Hugging Face hub does (for {f.where})",
        hint="check HF_ENDPOINT, your proxy and your certificates",
    )


def _cut_off(f: _Failure) -> SourceError:
    return SourceError(
        f"the download of {f.where} was cut off before the end",
        hint="run the command again; the hub cache does not take the cut file for the whole",
    )


def _os_error(f: _Failure) -> SourceError:
    e = f.error
    return SourceError(f"could not fetch {f.where}: {getattr(e, 'strerror', None) or e}")


def http_errors() -> tuple[type[BaseException], type[BaseException], type[BaseException]]:
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
