"""Hub failures against a local stand-in for the hub (tests.hubserver) on 127.0.0.1.

huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE once, when it is imported, so every command
runs in a fresh interpreter with the endpoint pointed at the stand-in and offline mode unset.
huggingface_hub retries a failing hub with a backoff of about 25 s; these runs replace its sleep
with a no-op (the retries still happen, only the waits are skipped).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.conftest import release_note
from tests.hubserver import COMMIT, FakeHub, closed_port

_HUB_MAJOR = int(version("huggingface_hub").split(".")[0])

_NO_WAIT = (
    "import sys, time, types\n"
    "import huggingface_hub.file_download as fd, huggingface_hub.utils._http as http\n"
    "fd.time = http.time = types.SimpleNamespace(**{**vars(time), 'sleep': lambda s: None})\n"
    "from embedlens.cli import main\n"
    "sys.argv[0] = 'embedlens'\n"
    "main()\n"
)


def run(
    endpoint: str,
    hf_home: Path,
    *args: str,
    offline: bool = False,
    env_more: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run embedlens in a fresh interpreter against a hub endpoint, with the cache in hf_home
    (offline: with HF_HUB_OFFLINE=1, the cache alone); env_more: more environment variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "HF_HUB_OFFLINE",
            "TRANSFORMERS_OFFLINE",
            "HF_TOKEN",
            "EMBEDLENS_DEBUG",
            "EMBEDLENS_CACHE",
        )
    }
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(hf_home), COLUMNS="140", **(env_more or {}))
    if offline:
        env.update(HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-c", _NO_WAIT, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def fails(result: subprocess.CompletedProcess[str], code: int = 1) -> str:
    """Assert the error contract on a finished run; return its stderr."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert result.stdout == ""
    lines = [line for line in result.stderr.strip().splitlines() if not release_note(line)]
    assert lines and lines[0].startswith("error: "), result.stderr
    assert len(lines) <= 2 and all(line.startswith(("error: ", "hint: ")) for line in lines), (
        result.stderr
    )
    return result.stderr


@pytest.fixture(scope="module")
def hub(tiny):
    """The stand-in hub, serving the tiny Llama under several behaviours."""
    with FakeHub(lifetime_s=600) as server:
        folder = tiny("llama-tied")
        server.add("org/ok", folder)
        server.add("org/missing", behaviour="missing")
        server.add("org/gated", folder, behaviour="gated")
        server.add("org/gated403", folder, behaviour="gated403")
        yield server


def test_repo_not_found(hub, tmp_path):
    err = fails(run(hub.url, tmp_path, "params", "org/missing"))
    assert "error: hub repository 'org/missing' was not found (or it is private)" in err
    assert "hint: check the spelling; for a private repo set HF_TOKEN" in err


@pytest.mark.parametrize("repo", ["org/gated", "org/gated403"])
def test_gated_repo(hub, tmp_path, repo):
    err = fails(run(hub.url, tmp_path, "tied", repo))
    assert f"error: '{repo}' is a gated repository and no token with access to it was found" in err
    assert "hint: accept its terms on the hub, then set HF_TOKEN" in err


def test_revision_not_found(hub, tmp_path):
    err = fails(run(hub.url, tmp_path, "params", "org/ok", "--revision", "v9"))
    assert "error: revision 'v9' was not found in 'org/ok'" in err
    assert "hint: give a branch, a tag or a commit hash" in err


@pytest.mark.parametrize(
    ("behaviour", "error", "hint"),
    [
        (
            "error",
            "answered 500 (a server error) for 'org/b-error/config.json'",
            "is failing or down",
        ),
        ("ratelimit", "refused more requests for now (429)", "wait a minute and retry"),
        ("nothub", "does not answer as a Hugging Face hub does", "check HF_ENDPOINT"),
    ],
)
def test_server_errors(hub, tmp_path, behaviour, error, hint):
    hub.add(f"org/b-{behaviour}", behaviour=behaviour)
    err = fails(run(hub.url, tmp_path, "params", f"org/b-{behaviour}"))
    assert f"error: the hub at {hub.url} " + error in err or f"error: {hub.url} " + error in err
    assert "hint: " in err and hint in err


@pytest.mark.slow
def test_connection_refused(tmp_path):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    err = fails(run(endpoint, tmp_path, "params", "org/ok"))
    assert f"error: could not connect to the hub at {endpoint}" in err
    assert "hint: check the network" in err


@pytest.mark.parametrize("where", ["closed port", "no such host"])
def test_an_unreachable_hub_is_said_without_retries(tmp_path, monkeypatch, where):
    """A file not in the cache from a hub that cannot be reached (a misspelled id offline): the
    error comes at once (one probe, at most PROBE_SECONDS), not after huggingface_hub's five
    retries over 23 s. The retries' waits are what is counted, not the clock, so a loaded
    machine cannot fail it."""
    import time

    from huggingface_hub import constants

    from embedlens.errors import SourceError
    from embedlens.io import hub

    endpoint = f"http://127.0.0.1:{closed_port()}" if where == "closed port" else "http://x.invalid"
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    hub._probe.cache_clear()
    waits: list[float] = []
    monkeypatch.setattr(time, "sleep", waits.append)
    with pytest.raises(SourceError, match=f"could not connect to the hub at {endpoint}"):
        hub.hub_file("org/misspeled", "config.json", None, required=True)
    assert waits == [] and hub.PROBE_SECONDS <= 5
    hub._probe.cache_clear()


def test_a_retry_on_a_closed_client_is_a_refused_connection():
    """huggingface_hub 1.3 closes its client on a refused connection and retries on the closed
    one: httpx's RuntimeError then stands for the connection (it was an internal error)."""
    from embedlens.io.hub import hub_error

    closed = RuntimeError("Cannot send a request, as the client has been closed.")
    said = hub_error(closed, "org/ok", "config.json", None)
    assert said is not None and said.message.startswith("could not connect to the hub at")
    assert hub_error(RuntimeError("something else"), "org/ok", "config.json", None) is None


def test_headers_read_over_ranges_without_downloading_weights(hub, tmp_path, tiny, cli):
    result = run(hub.url, tmp_path, "params", "org/ok", "--json")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    data = json.loads(result.stdout)
    assert data["source"] == "header"
    assert data["total"] == cli.json("params", tiny("llama-tied"))["total"]
    weights = [r for r in hub.log if r[0] == "GET" and r[1].endswith("/model.safetensors")]
    assert weights and all(r[2].startswith("bytes=0-") for r in weights), weights
    assert not [p for p in tmp_path.rglob("model.safetensors") if p.is_file()]


def _cache_files(hf_home: Path, repo: str) -> list[Path]:
    root = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


@pytest.mark.parametrize(("command", "name"), [("params", "config.json")])
def test_a_cut_download_never_looks_complete(hub, tmp_path, tiny, command, name):
    """The connection drops mid-file on every try: the command fails and the cache holds no part
    of the file; once the hub answers again, the next run downloads it whole. (Weights read by
    range: tests/test_hub_ranges.py; downloaded whole by lens: the test below.)"""
    folder = tiny("llama-tied")
    repo = f"org/drop-{command}"
    hub.add(repo, folder, behaviour="drop:" + name)
    args = [command, repo] + (["king"] if command == "neighbors" else [])
    err = fails(run(hub.url, tmp_path, *args))
    assert f"error: the download of '{repo}/{name}' was cut off before the end" in err
    original = (folder / name).read_bytes()
    for f in _cache_files(tmp_path, repo):
        if f.name.endswith(".incomplete") and _HUB_MAJOR < 2:
            continue  # huggingface_hub 1.x keeps what it read, to resume from, under this name
        assert not f.name.endswith(".incomplete"), f
        assert f.read_bytes() != original[: len(original) // 2], f
    snapshot = tmp_path / "hub" / ("models--" + repo.replace("/", "--")) / "snapshots" / COMMIT
    assert not (snapshot / name).exists()

    hub.repos[repo].behaviour = "ok"
    result = run(hub.url, tmp_path, *args, "--json")
    assert result.returncode == 0, result.stderr
    assert (snapshot / name).read_bytes() == original


def test_lens_reports_a_cut_download_of_the_weights(hub, tmp_path, tiny):
    """lens downloads through transformers, which wraps hub errors: the message is the same."""
    hub.add("org/drop-lens", tiny("llama-tied"), behaviour="drop:model.safetensors")
    err = fails(run(hub.url, tmp_path, "lens", "org/drop-lens", "the king"))
    assert "error: the download of 'org/drop-lens' was cut off before the end" in err
    if _HUB_MAJOR >= 2:  # huggingface_hub 1.x keeps what it read under *.incomplete
        assert not list(tmp_path.rglob("*.incomplete"))
    assert not [p for p in tmp_path.rglob("model.safetensors") if p.is_file()]


@pytest.mark.skipif(_HUB_MAJOR < 2, reason="huggingface_hub 1.x does not retry a cut download")
def test_a_retried_download_is_whole(hub, tmp_path, tiny):
    """The first try is cut mid-file; huggingface_hub tries again and the file cached is whole.

    (It resumes from the bytes it kept; with its 10 MB read chunks a small file starts over.)
    """
    folder = tiny("llama-tied")
    hub.add("org/flaky", folder, behaviour="flaky:model.safetensors")
    result = run(hub.url, tmp_path, "lens", "org/flaky", "the king", "--json")
    assert result.returncode == 0, result.stderr
    snapshot = tmp_path / "hub" / "models--org--flaky" / "snapshots" / COMMIT
    cached = (snapshot / "model.safetensors").read_bytes()
    assert cached == (folder / "model.safetensors").read_bytes()
    tries = [
        r
        for r in hub.log
        if r[0] == "GET" and r[1].startswith("/org/flaky/resolve/")
        if r[1].endswith("/model.safetensors")
        if not r[2] or r[2].endswith("-")
    ]
    assert len(tries) == 2, tries


def _shards_cached(hf_home: Path, repo: str) -> list[str]:
    snapshot = hf_home / "hub" / ("models--" + repo.replace("/", "--")) / "snapshots" / COMMIT
    return sorted(p.name for p in snapshot.glob("model-*.safetensors"))


def _without_ranges(report: dict[str, object]) -> dict[str, object]:
    """A report less what names how its bytes were read (the bytes fetched, the range note)."""
    out = {k: v for k, v in report.items() if k != "hub_fetched_bytes"}
    notes = report.get("notes")
    out["notes"] = [n for n in notes if " by range" not in n] if isinstance(notes, list) else []
    return out


@pytest.mark.parametrize("matrix", ["input", "output"])
def test_a_sharded_repo_read_by_one_run_serves_the_next_offline(hub, tmp_path, tiny, matrix):
    """Online, neighbors fetches only the byte range of the matrix in its shard (nothing goes in
    the hub cache's snapshots); offline, the same command reads the kept range and prints the
    same, and addr reads its rows back from it."""
    folder = tiny("llama-untied", max_shard_size="20KB")
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert len(shards) > 2
    repo = f"org/sharded-{matrix}"
    hub.add(repo, folder)
    args = ["--matrix", matrix, "--json"]
    online = run(hub.url, tmp_path, "neighbors", repo, "king", *args)
    assert online.returncode == 0, online.stderr
    assert _shards_cached(tmp_path, repo) == []
    offline = run(hub.url, tmp_path, "neighbors", repo, "king", *args, offline=True)
    assert offline.returncode == 0, offline.stderr
    assert _without_ranges(json.loads(offline.stdout)) == _without_ranges(json.loads(online.stdout))
    tensor = json.loads(online.stdout)["tensor"]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    addr = run(hub.url, tmp_path, "addr", repo, "3", "king", *args, offline=True)
    assert addr.returncode == 0, addr.stderr
    report = json.loads(addr.stdout)
    assert [r["file"] for r in report["rows"]] == [index["weight_map"][tensor]] * 2
    assert [r["check"] for r in report["rows"]] == [True, True], report
    assert _shards_cached(tmp_path, repo) == []


def test_offline_a_shard_a_command_needs_is_named(hub, tmp_path, tiny):
    """Offline, a command whose weights file is in neither cache names that file: addr, whose
    online run kept its ranges elsewhere (EMBEDLENS_CACHE), and params, which reads every
    shard's header."""
    folder = tiny("llama-untied", max_shard_size="20KB")
    repo = "org/sharded-named"
    hub.add(repo, folder)
    elsewhere = {"EMBEDLENS_CACHE": str(tmp_path / "elsewhere")}
    online = run(hub.url, tmp_path, "addr", repo, "3", "--json", env_more=elsewhere)
    assert online.returncode == 0, online.stderr
    assert _shards_cached(tmp_path, repo) == []
    shard = json.loads(online.stdout)["rows"][0]["file"]
    err = fails(run(hub.url, tmp_path, "addr", repo, "3", offline=True))
    assert (
        f"error: '{repo}' is not in the local hub cache ({shard}) and HF_HUB_OFFLINE is set" in err
    )
    err = fails(run(hub.url, tmp_path, "params", repo, offline=True))
    first = sorted(p.name for p in folder.glob("model-*.safetensors"))[0]
    assert f"error: '{repo}' is not in the local hub cache ({first}, and " in err
