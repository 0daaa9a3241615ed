"""Byte ranges of hub files, fetched through huggingface_hub and kept in a cache of their own.

A command that reads one tensor of a hub file the hub cache does not hold fetches that tensor's
bytes alone: the file's resolved URL, headers (token), redirects, proxies and retries come from
huggingface_hub (`get_hf_file_metadata`, `build_hf_headers`, `http_stream_backoff`), with one
range per request. What was fetched is kept under `EMBEDLENS_CACHE` (default
`$HF_HOME/embedlens/ranges`), never in the hub cache's `snapshots/` where transformers would take
a part for the whole file:

    <cache>/models--org--name/<commit>/<quoted file>/<etag>/<start>-<stop>

each range written to a temporary name and renamed into place, and checked by size when read.
With HF_HUB_OFFLINE=1 the commit comes from the hub cache's `refs/` (or the kept ranges' own,
written when a revision was resolved online), and a kept range that covers the bytes asked for
is read; otherwise the file is named in the error.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urlsplit

from embedlens.errors import SourceError
from embedlens.io.hub import hub_error, hub_offline, quiet_hub

_RANGE = re.compile(r"^(\d+)-(\d+)$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_TRIES = 3
"""Requests for one range: a cut answer is asked again for what is missing, twice at most."""
BAR_BYTES = 16 << 20
"""Ranges from this size on show a progress bar (on a terminal)."""

ProgressFactory = Callable[[str, int], AbstractContextManager[Callable[[int], None]]]
_progress: dict[str, ProgressFactory | None] = {"bar": None}


def set_progress(factory: ProgressFactory | None) -> None:
    """Set what shows a large range's progress: factory(label, total) gives a context whose
    value is called with each chunk's size (the command line's Rich bar on stderr)."""
    _progress["bar"] = factory


@dataclass(frozen=True)
class HubFile:
    """One file of a hub repo at one commit, as the hub describes it."""

    repo_id: str
    filename: str
    revision: str | None
    commit: str
    etag: str
    size: int
    url: str | None
    """Where its bytes are asked for (after redirects); None offline."""
    headers: dict[str, str] = field(default_factory=dict, compare=False, repr=False)


@dataclass
class Tally:
    """What the ranged reads of one command read and fetched, by file."""

    files: dict[str, int] = field(default_factory=dict)
    """File name to its size."""
    data: dict[str, int] = field(default_factory=dict)
    """File name to the tensor bytes read from it."""
    fetched: int = 0
    """Bytes received from the hub (headers and tensors)."""
    data_fetched: dict[str, int] = field(default_factory=dict)
    """File name to the tensor bytes of it received from the hub (the rest were kept)."""

    @property
    def used(self) -> bool:
        """Whether anything was read by range."""
        return bool(self.files)

    def notes(self) -> list[str]:
        """One note per file whose tensor bytes were read by range."""
        out = []
        for name, read in self.data.items():
            got = self.data_fetched.get(name, 0)
            kept = (
                ""
                if got == read
                else ", kept from an earlier run (nothing fetched)"
                if got == 0
                else f" ({decimal_size(got)} fetched, the rest kept from an earlier run)"
            )
            out.append(
                f"read {decimal_size(read)} of {name} ({decimal_size(self.files[name])}) by "
                f"range{kept}"
            )
        return out


_tallies: list[Tally] = []
_lock = threading.Lock()


@contextmanager
def tally() -> Iterator[Tally]:
    """Count the ranged reads made inside the block."""
    current = Tally()
    _tallies.append(current)
    try:
        yield current
    finally:
        _tallies.remove(current)


def _count(hub: HubFile, *, fetched: int = 0, data: int = 0) -> None:
    with _lock:
        _count_locked(hub, fetched, data)


def _count_locked(hub: HubFile, fetched: int, data: int) -> None:
    for t in _tallies:
        t.files[hub.filename] = hub.size
        t.fetched += fetched
        if data:
            t.data[hub.filename] = t.data.get(hub.filename, 0) + data
            got = fetched if data == fetched else 0
            t.data_fetched[hub.filename] = t.data_fetched.get(hub.filename, 0) + got


def decimal_size(n: int) -> str:
    """Bytes in decimal units with 3 significant digits, e.g. '311 MB', '1.5 GB'."""
    if n < 1000:
        return f"{n} bytes"
    value = float(n)
    for unit in ("KB", "MB", "GB", "TB"):
        value /= 1000
        if value < 999.5 or unit == "TB":
            return f"{value:.3g} {unit}"
    return f"{n} bytes"  # pragma: no cover


def cache_root() -> Path:
    """The folder of kept ranges: EMBEDLENS_CACHE, else $HF_HOME/embedlens/ranges."""
    own = os.environ.get("EMBEDLENS_CACHE", "").strip()
    if own:
        return Path(own).expanduser()
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "embedlens" / "ranges"


def _repo_dir(repo_id: str) -> str:
    return "models--" + repo_id.replace("/", "--")


_described: dict[tuple[str, str, str | None], HubFile] = {}


def describe(repo_id: str, filename: str, revision: str | None) -> HubFile:
    """The file's commit, ETag, size and resolved URL: a HEAD request (huggingface_hub's
    EntryNotFoundError when the repo lacks the file), or offline the kept ranges' folder
    (SourceError naming the file when nothing of it was kept)."""
    key = (repo_id, filename, revision)
    if key not in _described:
        found = _described_offline(*key) if hub_offline() else _described_online(*key)
        _described[key] = found
    return _described[key]


def _described_online(repo_id: str, filename: str, revision: str | None) -> HubFile:
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import EntryNotFoundError
    from huggingface_hub.utils import build_hf_headers

    quiet_hub()
    url = hf_hub_url(repo_id, filename, revision=revision)
    try:
        meta = get_hf_file_metadata(url, retry_on_errors=True)
    except EntryNotFoundError:
        raise  # the caller asked whether the file exists
    except Exception as e:
        error = hub_error(e, repo_id, filename, revision)
        if error is None:
            raise
        raise error from e
    if not meta.commit_hash or not meta.etag or meta.size is None:
        raise SourceError(
            f"the hub did not give the commit, ETag and size of '{repo_id}/{filename}'",
            hint="check HF_ENDPOINT, your proxy and your certificates",
        )
    _remember_commit(repo_id, revision, meta.commit_hash)
    headers = build_hf_headers()
    location = meta.location or url
    if location != url and not same_or_hub_host(url, location):
        headers.pop("authorization", None)  # a signed CDN URL, as hf_hub_download does
    return HubFile(
        repo_id, filename, revision, meta.commit_hash, meta.etag, meta.size, location, headers
    )


_HUB_ORIGINS = ("https://huggingface.co", "https://hub-ci.huggingface.co", "https://hf.co")
"""The hub's own origins, besides HF_ENDPOINT's: the token may be sent there."""


def same_or_hub_host(url: str, target: str) -> bool:
    """Whether `target` is served by the origin of `url` (scheme, host, port) or by the hub
    (HF_ENDPOINT, huggingface.co, hf.co): a redirect elsewhere (a CDN's signed URL) is sent no
    token. The rule huggingface_hub's downloads follow, written here from public names."""
    from huggingface_hub import constants

    hub = {_origin(o) for o in (*_HUB_ORIGINS, constants.ENDPOINT)}
    return _origin(target) in {_origin(url), *hub}


def _origin(url: str) -> tuple[str, str, int]:
    parsed = urlsplit(url)
    scheme = parsed.scheme.lower()
    try:
        port = parsed.port
    except ValueError:  # a port out of range: no origin of the hub's
        port = -1
    default = {"http": 80, "https": 443}.get(scheme, 0)
    return scheme, (parsed.hostname or "").lower(), default if port is None else port


def _commit_offline(repo_id: str, revision: str | None) -> str | None:
    """The commit a revision names, from the hub cache's refs/ (or the revision itself)."""
    wanted = revision or "main"
    if _COMMIT.match(wanted):
        return wanted
    from huggingface_hub import constants

    for refs in (
        Path(constants.HF_HUB_CACHE) / _repo_dir(repo_id),
        cache_root() / _repo_dir(repo_id),
    ):
        try:
            return (refs / "refs" / wanted).read_text(encoding="utf-8").strip() or None
        except OSError:
            continue
    return None


def _remember_commit(repo_id: str, revision: str | None, commit: str) -> None:
    """Keep the commit a revision named (in the kept ranges' own refs/), for offline runs that
    find nothing of the repo in the hub cache (a hub GGUF: no file of it is downloaded)."""
    wanted = revision or "main"
    if _COMMIT.match(wanted) or "/" in wanted or wanted.startswith("."):
        return
    folder = cache_root() / _repo_dir(repo_id) / "refs"
    path = folder / wanted
    try:
        if path.is_file() and path.read_text(encoding="utf-8").strip() == commit:
            return
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{wanted}.{os.getpid()}"
        tmp.write_text(commit, encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass  # only offline runs need it


def _described_offline(repo_id: str, filename: str, revision: str | None) -> HubFile:
    commit = _commit_offline(repo_id, revision)
    folder = cache_root() / _repo_dir(repo_id) / (commit or "-") / quote(filename, safe="")
    kept = sorted(folder.glob("*/size"), key=lambda p: p.stat().st_mtime) if commit else []
    for size_file in reversed(kept):
        try:
            size = int(size_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        assert commit is not None
        return HubFile(repo_id, filename, revision, commit, size_file.parent.name, size, None)
    raise not_kept(repo_id, filename)


def has_kept(repo_id: str, filename: str, revision: str | None) -> bool:
    """Whether ranges of a hub file at the revision's cached commit were kept."""
    if (repo_id, filename, revision) in _described:
        return True
    try:
        _described_offline(repo_id, filename, revision)
    except SourceError:
        return False
    return True


def not_kept(repo_id: str, filename: str) -> SourceError:
    """Offline, and neither cache holds the bytes of a file that are needed."""
    return SourceError(
        f"'{repo_id}' is not in the local hub cache ({filename}) and HF_HUB_OFFLINE is set",
        hint="unset HF_HUB_OFFLINE to fetch what the command reads, or give a local folder",
    )


def _folder(hub: HubFile) -> Path:
    etag = quote(hub.etag, safe="")
    return cache_root() / _repo_dir(hub.repo_id) / hub.commit / quote(hub.filename, safe="") / etag


def _kept(hub: HubFile, start: int, stop: int) -> tuple[Path, int] | None:
    """A kept range of the file covering start..stop-1, whole by size: (path, its start)."""
    folder = _folder(hub)
    try:
        names = [p.name for p in folder.iterdir()]
    except OSError:
        return None
    for name in sorted(names):
        m = _RANGE.match(name)
        if m is None:
            continue
        lo, hi = int(m.group(1)), int(m.group(2))
        if lo <= start and stop <= hi:
            path = folder / name
            try:
                if path.stat().st_size == hi - lo:
                    return path, lo
            except OSError:
                continue
    return None


def read_range(hub: HubFile, start: int, stop: int, *, data: bool = True) -> tuple[Path, int]:
    """A file on disk holding bytes start..stop-1 of the hub file: (path, the file offset of its
    first byte). Kept ranges are used first; offline, SourceError names the file when none
    covers the bytes. `data`: tensor bytes (counted in the note), not a header."""
    stop = min(stop, hub.size)
    found = _kept(hub, start, stop)
    if found is None:
        if hub.url is None:
            raise not_kept(hub.repo_id, hub.filename)
        found = _fetch(hub, start, stop), start
        _count(hub, fetched=stop - start, data=stop - start if data else 0)
    else:
        _count(hub, data=stop - start if data else 0)
    return found


def read_bytes(hub: HubFile, start: int, stop: int) -> bytes:
    """Bytes start..stop-1 of the hub file (a header), kept for the next run."""
    path, base = read_range(hub, start, stop, data=False)
    with open(path, "rb") as fh:
        fh.seek(start - base)
        return fh.read(min(stop, hub.size) - start)


def _fetch(hub: HubFile, start: int, stop: int) -> Path:
    """Fetch a range into the cache, atomically: asked again for what is missing when an
    answer is cut, refused after _TRIES answers."""
    folder = _folder(hub)
    folder.mkdir(parents=True, exist_ok=True)
    _write_size(folder, hub.size)
    final = folder / f"{start}-{stop}"
    tmp = folder / f".{start}-{stop}.{os.getpid()}.part"
    bar = _progress["bar"]
    show = bar is not None and stop - start >= BAR_BYTES
    label = f"Fetching {hub.filename} bytes {start:,}-{stop - 1:,}"
    context = bar(label, stop - start) if show and bar is not None else nullcontext(_ignore)
    try:
        with open(tmp, "wb") as out, context as advance:
            got = 0
            for _ in range(_TRIES):
                got += _get(hub, start + got, stop, out, advance)
                if got == stop - start:
                    break
            else:
                raise SourceError(
                    f"the hub's answers for '{hub.repo_id}/{hub.filename}' (bytes {start}-"
                    f"{stop - 1}) were cut off before the end {_TRIES} times",
                    hint="run the command again; nothing partial was kept",
                )
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return final


def _ignore(n: int) -> None:
    pass


def _write_size(folder: Path, size: int) -> None:
    path = folder / "size"
    if path.exists():
        return
    tmp = folder / f".size.{os.getpid()}"
    tmp.write_text(str(size), encoding="utf-8")
    os.replace(tmp, path)


def _get(hub: HubFile, start: int, stop: int, out: object, advance: Callable[[int], None]) -> int:
    """One request for bytes start..stop-1, written to out; the bytes received (fewer when the
    answer was cut). A server that ignores the range is stopped before its body is read."""
    from huggingface_hub.utils import hf_raise_for_status, http_stream_backoff

    from embedlens.io.hub import http_errors

    assert hub.url is not None
    transport = http_errors()[2]  # raised while the body is read: the answer was cut
    headers = {**hub.headers, "Range": f"bytes={start}-{stop - 1}", "Accept-Encoding": "identity"}
    got = 0
    try:
        with http_stream_backoff("GET", hub.url, headers=headers) as response:
            hf_raise_for_status(response)
            _check_range(hub, response, start, stop)
            try:
                for chunk in response.iter_bytes():  # as received: a cut keeps what came
                    chunk = chunk[: stop - start - got]
                    out.write(chunk)  # type: ignore[attr-defined]
                    got += len(chunk)
                    advance(len(chunk))
                    if got == stop - start:
                        break
            except transport:
                pass  # cut off: the caller asks again for the rest
    except SourceError:
        raise
    except Exception as e:
        error = hub_error(e, hub.repo_id, hub.filename, hub.revision)
        if error is None:
            raise
        raise error from e
    return got


def _check_range(hub: HubFile, response: object, start: int, stop: int) -> None:
    """SourceError unless the answer is the range asked for (206 with its Content-Range)."""
    status = getattr(response, "status_code", None)
    headers = getattr(response, "headers", {})
    whole = start == 0 and stop == hub.size
    if status == 200 and whole:
        return
    expected = f"bytes {start}-{stop - 1}/"
    if status == 206 and str(headers.get("Content-Range", "")).startswith(expected):
        return
    from huggingface_hub import constants

    what = (
        f"began sending the whole file ({hub.size:,} bytes)"
        if status == 200
        else f"answered {status} with {headers.get('Content-Range') or 'no Content-Range'}"
    )
    raise SourceError(
        f"the hub at {constants.ENDPOINT} ignored the byte range asked of "
        f"'{hub.repo_id}/{hub.filename}' (bytes {start}-{stop - 1}) and {what}: stopped",
        hint="check HF_ENDPOINT and your proxy (they must pass Range requests on), or "
        "download the file and give a local folder",
    )
