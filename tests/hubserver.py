"""A stand-in for the Hugging Face hub on 127.0.0.1, serving files and the hub's failures.

huggingface_hub downloads a file with a HEAD then a GET of `/{repo}/resolve/{revision}/{file}`
and reads the hub's headers: X-Repo-Commit, ETag, Content-Length, and, on failure, X-Error-Code
(RepoNotFound, GatedRepo, RevisionNotFound, EntryNotFound). Each repo here has a behaviour:

- "ok": its files are served;
- "missing": 404 RepoNotFound; "gated": 401 GatedRepo; "gated403": 403 GatedRepo;
- "error": 500 on every request; "ratelimit": 429 on every request;
- "nothub": 200 without the hub's headers (an HF_ENDPOINT that is some other web server);
- "drop:NAME": a download of NAME (a whole-file GET, or a resumed one: `Range: bytes=N-`) sends
  half its bytes, then the connection is closed; closed ranges (header reads) are answered;
- "flaky:NAME": the first download of NAME is cut so; the resumed one is answered;
- "norange:NAME": a GET of NAME ignores its Range header and answers 200 with the whole file;
- "cutrange:NAME": every GET of a closed range of NAME (`bytes=A-B`) sends half of it, then the
  connection is closed;
- "cdn:NAME": NAME is redirected (302, with the hub's X-Linked-Etag and X-Linked-Size) to
  `http://localhost:PORT/_cdn/REPO/NAME`, another origin, as the hub sends an LFS file to its CDN;
  there it is served (ranges too).

`auth` holds (path, Authorization header or "") for every request.

`sent` counts the body bytes written for each `repo/file` (a body the client stops reading is
counted up to where the connection broke); `GET /_sent` answers it as JSON and starts it afresh.

`/api/models/{repo}` (model_info) and its `tree` listing answer too, as the hub does for a repo
whose files all sit at the top: a sub-folder is 404 EntryNotFound.

Revisions other than "main" and the repo's commit answer 404 RevisionNotFound. The server lives in
a daemon thread, answers at most `max_requests` requests and shuts down by itself after
`lifetime_s` seconds, so a test that forgets it leaves nothing running.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

COMMIT = "c0ffee" + "0" * 34
_PIECE = 1 << 18  # bytes written at a time


@dataclass
class Repo:
    """A hub repo: behaviour and files."""

    behaviour: str = "ok"
    files: dict[str, bytes] = field(default_factory=dict)


class FakeHub:
    """The server; `repos` may be changed between requests."""

    def __init__(self, *, max_requests: int = 500, lifetime_s: float = 120.0) -> None:
        self.repos: dict[str, Repo] = {}
        self.log: list[tuple[str, str, str]] = []
        """(method, path, Range header) of every request."""
        self.auth: list[tuple[str, str]] = []
        """(path, Authorization header or "") of every request."""
        self.sent: dict[str, int] = {}
        """Body bytes written, by 'repo/file'."""
        self._lock = threading.Lock()
        self._etags: list[tuple[bytes, str]] = []
        self.max_requests = max_requests
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def do_GET(self) -> None:
                hub._answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._deadline = threading.Timer(lifetime_s, self.stop)
        self._deadline.daemon = True

    def __enter__(self) -> FakeHub:
        self._thread.start()
        self._deadline.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        self._deadline.cancel()
        if self._thread.is_alive():
            self.server.shutdown()
        self.server.server_close()

    def add(self, repo_id: str, folder: Path | None = None, behaviour: str = "ok") -> Repo:
        """Serve a repo: the files of a folder (top level), with a behaviour."""
        files = {}
        if folder is not None:
            files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
        self.repos[repo_id] = Repo(behaviour, files)
        return self.repos[repo_id]

    def _answer(self, h: BaseHTTPRequestHandler, *, body: bool) -> None:
        self.log.append((h.command, h.path, h.headers.get("Range", "")))
        self.auth.append((h.path, h.headers.get("Authorization", "")))
        if len(self.log) > self.max_requests:
            return self._send(h, 503, {}, b"", body=body)
        if h.path == "/_sent":  # the counts so far, then counted afresh (for bench/run.py)
            with self._lock:
                sent, self.sent = self.sent, {}
            return self._send(h, 200, {}, json.dumps(sent).encode(), body=body)
        parts = unquote(h.path.split("?", 1)[0]).strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            return self._api(h, "/".join(parts[2:4]), parts[4:], body=body)
        if parts[0] == "_cdn" and len(parts) >= 4:  # the CDN's copy of a "cdn:NAME" file
            parts = [*parts[1:3], "resolve", COMMIT, *parts[3:]]
        elif len(parts) >= 5 and parts[2] == "resolve":
            repo = self.repos.get("/".join(parts[:2]))
            if repo is not None and repo.behaviour == "cdn:" + "/".join(parts[4:]):
                return self._redirect(h, "/".join(parts[:2]), "/".join(parts[4:]), body=body)
        if len(parts) < 5 or parts[2] != "resolve":
            return self._send(h, 404, {"X-Error-Code": "RepoNotFound"}, b"", body=body)
        repo_id, revision, filename = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
        repo = self.repos.get(repo_id)
        if repo is None or repo.behaviour == "missing":
            return self._send(h, 404, {"X-Error-Code": "RepoNotFound"}, b"", body=body)
        if repo.behaviour.startswith("gated"):
            status = 403 if repo.behaviour == "gated403" else 401
            msg = "Access to model is restricted. You must have access to it and be authenticated."
            headers = {"X-Error-Code": "GatedRepo", "X-Error-Message": msg}
            return self._send(h, status, headers, b"", body=body)
        if repo.behaviour == "error":
            return self._send(h, 500, {}, b"Internal Error", body=body)
        if repo.behaviour == "ratelimit":
            return self._send(h, 429, {}, b"Too Many Requests", body=body)
        if repo.behaviour == "nothub":
            return self._send(h, 200, {}, b"<html>hello</html>", body=body)
        if revision not in ("main", COMMIT):
            return self._send(h, 404, {"X-Error-Code": "RevisionNotFound"}, b"", body=body)
        data = repo.files.get(filename)
        commit = {"X-Repo-Commit": COMMIT}
        if data is None:
            return self._send(h, 404, {**commit, "X-Error-Code": "EntryNotFound"}, b"", body=body)
        headers = {**commit, "ETag": self._etag(data)}
        wanted = h.headers.get("Range", "")
        lo, hi = 0, len(data) - 1
        if wanted.startswith("bytes="):
            first, _, last = wanted[6:].partition("-")
            lo, hi = int(first), min(int(last) if last else hi, hi)
        download = not wanted or wanted.endswith("-")
        key = f"{repo_id}/{filename}"
        if body and repo.behaviour == "norange:" + filename:
            return self._stream(h, key, 200, headers, data)
        if body and wanted and not download and repo.behaviour == "cutrange:" + filename:
            headers["Content-Range"] = f"bytes {lo}-{hi}/{len(data)}"
            self._count(key, (hi + 1 - lo) // 2)
            return self._drop(h, 206, headers, data[lo : hi + 1])
        if body and download and repo.behaviour in ("drop:" + filename, "flaky:" + filename):
            if repo.behaviour.startswith("flaky"):
                repo.behaviour = "ok"
            if lo:
                headers["Content-Range"] = f"bytes {lo}-{hi}/{len(data)}"
            self._count(key, (len(data) - lo) // 2)
            return self._drop(h, 206 if lo else 200, headers, data[lo:])
        if body and wanted:
            headers["Content-Range"] = f"bytes {lo}-{hi}/{len(data)}"
            return self._stream(h, key, 206, headers, data[lo : hi + 1])
        if body:
            return self._stream(h, key, 200, headers, data)
        return self._send(h, 200, headers, data, body=body)

    def _redirect(self, h: BaseHTTPRequestHandler, repo_id: str, name: str, *, body: bool) -> None:
        """The hub's answer for an LFS file kept on a CDN: 302 to another origin."""
        data = self.repos[repo_id].files.get(name)
        if data is None:
            return self._send(h, 404, {"X-Error-Code": "EntryNotFound"}, b"", body=body)
        port = self.server.server_address[1]
        headers = {
            "X-Repo-Commit": COMMIT,
            "X-Linked-Etag": self._etag(data),
            "X-Linked-Size": str(len(data)),
            "ETag": '"pointer"',
            "Location": f"http://localhost:{port}/_cdn/{repo_id}/{name}",
        }
        return self._send(h, 302, headers, b"", body=body)

    def _etag(self, data: bytes) -> str:
        """The file's ETag (its sha256, as the hub gives for LFS files), hashed once a file."""
        with self._lock:
            for known, etag in self._etags:
                if known is data:
                    return etag
        etag = '"' + hashlib.sha256(data).hexdigest() + '"'
        with self._lock:
            self._etags.append((data, etag))
        return etag

    def _count(self, key: str, n: int) -> None:
        with self._lock:
            self.sent[key] = self.sent.get(key, 0) + n

    def _stream(
        self, h: BaseHTTPRequestHandler, key: str, status: int, headers: dict[str, str], data: bytes
    ) -> None:
        """Send a body in pieces, counting what was written until the client hung up."""
        self._head(h, status, headers, len(data))
        view = memoryview(data)
        for i in range(0, len(data), _PIECE):
            try:
                h.wfile.write(view[i : i + _PIECE])
                h.wfile.flush()
            except OSError:
                h.close_connection = True
                return
            self._count(key, len(view[i : i + _PIECE]))

    def _api(self, h: BaseHTTPRequestHandler, repo_id: str, rest: list[str], *, body: bool) -> None:
        """model_info (`/api/models/{repo}`) and the tree listing (`.../tree/{rev}/{path}`)."""
        repo = self.repos.get(repo_id)
        if repo is None or repo.behaviour in ("missing", "gated", "gated403", "error"):
            status = {"gated": 401, "gated403": 403, "error": 500}.get(
                repo.behaviour if repo else "", 404
            )
            code = "GatedRepo" if status in (401, 403) else "RepoNotFound"
            return self._send(
                h, status, {"X-Error-Code": code} if status < 500 else {}, b"", body=body
            )
        files = [{"type": "file", "path": n, "size": len(d)} for n, d in sorted(repo.files.items())]
        if not rest:
            info = {
                "id": repo_id,
                "sha": COMMIT,
                "siblings": [{"rfilename": f["path"]} for f in files],
            }
            return self._send(h, 200, {}, json.dumps(info).encode(), body=body)
        if rest[0] == "tree" and len(rest) <= 2:  # the top folder: every file
            return self._send(h, 200, {}, json.dumps(files).encode(), body=body)
        return self._send(h, 404, {"X-Error-Code": "EntryNotFound"}, b"", body=body)

    @staticmethod
    def _send(
        h: BaseHTTPRequestHandler, status: int, headers: dict[str, str], data: bytes, *, body: bool
    ) -> None:
        FakeHub._head(h, status, headers, len(data))
        if body:
            h.wfile.write(data)

    @staticmethod
    def _head(h: BaseHTTPRequestHandler, status: int, headers: dict[str, str], length: int) -> None:
        """The status line and headers of an answer whose body has `length` bytes."""
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(length))
        h.end_headers()

    @staticmethod
    def _drop(h: BaseHTTPRequestHandler, status: int, headers: dict[str, str], data: bytes) -> None:
        """Announce all of data, send half of it, and close the connection."""
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data[: len(data) // 2])
        h.wfile.flush()
        time.sleep(0.05)
        h.close_connection = True
        with contextlib.suppress(OSError):  # the client may have hung up first
            h.connection.shutdown(2)  # SHUT_RDWR


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
