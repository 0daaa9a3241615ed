"""Hub reads by range: neighbors, addr and vocab fetch only the tensor (or rows) they read.

Against the local stand-in for the hub (tests.hubserver), which counts the body bytes it sends.
The served model is a tiny Llama with one wide layer (6 MB of weights, a 147 KB embedding past
the first 100 KB), so that fetching the embedding alone and fetching the file differ.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from embedlens.io.ranges import Tally, decimal_size
from tests.hubserver import COMMIT, FakeHub
from tests.test_hub_failures import fails, run

WEIGHTS = "model.safetensors"
FIRST_RANGE = 100_000  # the first bytes read for a header, as huggingface_hub reads them
SMALL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny untied Llama with one 512-wide layer, saved with the tests' tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.models import FAMILIES, write_tokenizer

    raw = {**FAMILIES["llama-untied"], "hidden_size": 512, "intermediate_size": 512}
    raw["num_hidden_layers"] = 1
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("wide")
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def hub(wide: Path):
    """The stand-in hub serving the wide model (and, per test, repos of their own)."""
    with FakeHub(lifetime_s=900) as server:
        server.add("org/wide", wide)
        yield server


def _tensor(folder: Path, name: str) -> dict[str, Any]:
    """A tensor's header entry, with `offset` its absolute file offset."""
    raw = (folder / WEIGHTS).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    info: dict[str, Any] = json.loads(raw[8 : 8 + n])[name]
    begin, end = info["data_offsets"]
    return {**info, "offset": 8 + n + begin, "nbytes": end - begin, "header": 8 + n}


def same_report(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Two reports equal apart from what names the source: MODEL, the bytes fetched, the note."""
    for d in (a, b):
        d.pop("hub_fetched_bytes", None)
        d.pop("model")
        d["notes"] = [n for n in d.get("notes", []) if " by range" not in n]
    assert a == b


def reruns_offline(hub: FakeHub, home: Path, args: list[str], online: str) -> None:
    """Offline, the same command answers as it did online (`online`, its stdout) from what was
    kept, fetching nothing."""
    before = dict(hub.sent)
    offline = run(hub.url, home, *args, offline=True)
    assert offline.returncode == 0, offline.stderr
    assert hub.sent == before
    again = json.loads(offline.stdout)
    assert again["hub_fetched_bytes"] == 0
    assert "kept from an earlier run (nothing fetched)" in offline.stderr
    same_report(again, json.loads(online))


def _kept_bytes(ranges: Path) -> list[Path]:
    """Kept files of bytes (not a file's size, not the commit a revision named)."""
    return [
        p for p in ranges.rglob("*") if p.is_file() and p.name != "size" and "refs" not in p.parts
    ]


def _snapshot(hf_home: Path, repo: str) -> Path:
    return hf_home / "hub" / ("models--" + repo.replace("/", "--")) / "snapshots" / COMMIT


ARGS = {
    "neighbors": ["king", "queen", "--matrix", "output"],
    "addr": ["3", "king", "--matrix", "output"],
    "vocab": [],
}


@pytest.mark.parametrize("command", ["neighbors", "addr", "vocab"])
def test_a_command_fetches_the_tensor_alone_and_answers_as_the_folder_does(
    hub, wide, tmp_path, cli, command
):
    repo = f"org/wide-{command}"
    hub.add(repo, wide)
    args = [command, repo, *ARGS[command], "--json"]
    online = run(hub.url, tmp_path, *args)
    assert online.returncode == 0, online.stderr
    head = _tensor(wide, "lm_head.weight")
    read = head["nbytes"] if command != "addr" else 2 * head["nbytes"] // head["shape"][0]
    if command == "vocab":  # an untied model: the embedding is scanned beside the head
        read += _tensor(wide, "model.embed_tokens.weight")["nbytes"]
    size = (wide / WEIGHTS).stat().st_size
    assert f"note: read {decimal_size(read)} of {WEIGHTS} ({decimal_size(size)}) by range" in (
        online.stderr
    )
    sent = {k.split("/", 2)[2]: v for k, v in hub.sent.items() if k.startswith(repo + "/")}
    weights = sent.pop(WEIGHTS)
    assert weights <= read + FIRST_RANGE + head["header"], (weights, read)
    assert set(sent) <= set(SMALL_FILES), sent
    report = json.loads(online.stdout)
    assert report["hub_fetched_bytes"] == weights
    local = cli.json(command, wide, *ARGS[command])
    assert "hub_fetched_bytes" not in local or local["hub_fetched_bytes"] is None
    same_report(dict(report), local)
    # Nothing partial where transformers would take it for the whole file.
    snapshot = _snapshot(tmp_path, repo)
    assert not (snapshot / WEIGHTS).exists()
    assert not [p for p in (tmp_path / "hub").rglob("*") if p.is_file() and p.stat().st_size > 1e5]
    reruns_offline(hub, tmp_path, args, online.stdout)


def test_a_large_range_is_asked_in_one_request(hub, wide, tmp_path):
    """The embedding comes in one GET of exactly its bytes (one range per request)."""
    repo = "org/wide-one-range"
    hub.add(repo, wide)
    result = run(hub.url, tmp_path, "neighbors", repo, "king", "--json")
    assert result.returncode == 0, result.stderr
    embed = _tensor(wide, "model.embed_tokens.weight")
    gets = [r[2] for r in hub.log if r[0] == "GET" and r[1] == f"/{repo}/resolve/main/{WEIGHTS}"]
    first, last = embed["offset"], embed["offset"] + embed["nbytes"] - 1
    assert gets == [f"bytes=0-{FIRST_RANGE - 1}", f"bytes={first}-{last}"], gets
    assert all("," not in g for g in gets)


def test_a_file_on_another_origin_is_read_there_without_the_token(hub, wide, tmp_path):
    """The hub sends the weights to a CDN (302 to another origin): the ranges are read there,
    without the token the hub itself is sent, and the answer is the folder's."""
    repo = "org/wide-cdn"
    hub.add(repo, wide, behaviour=f"cdn:{WEIGHTS}")
    token = {"HF_TOKEN": "hf_embedlens_test_token"}
    args = ["neighbors", repo, *ARGS["neighbors"], "--json"]
    online = run(hub.url, tmp_path, *args, env_more=token)
    assert online.returncode == 0, online.stderr
    cdn = [a for path, a in hub.auth if path.startswith(f"/_cdn/{repo}/")]
    hub_side = [a for path, a in hub.auth if path.startswith(f"/{repo}/resolve/")]
    assert cdn and not any(cdn), hub.auth  # ranges read at the CDN, no token sent there
    assert hub_side and all(a == "Bearer " + token["HF_TOKEN"] for a in hub_side)
    assert hub.sent.get(f"{repo}/{WEIGHTS}", 0) > 0
    same_report(json.loads(online.stdout), json.loads(run(hub.url, tmp_path, *args).stdout))
    from embedlens.io.ranges import same_or_hub_host

    here = "http://127.0.0.1:8000/x"
    assert same_or_hub_host(here, "http://127.0.0.1:8000/y")
    assert not same_or_hub_host(here, "http://localhost:8000/y")
    assert not same_or_hub_host(here, "http://127.0.0.1:8001/y")
    assert same_or_hub_host("https://hf.co/a", "https://huggingface.co:443/b")
    assert not same_or_hub_host("https://huggingface.co/a", "https://cdn-lfs.hf.co/b")


def test_params_tied_and_vocab_layout_need_no_weight_bytes(hub, wide, tmp_path):
    repo = "org/wide-headers"
    hub.add(repo, wide)
    for command in ("params", "tied"):
        result = run(hub.url, tmp_path, command, repo, "--json")
        assert result.returncode == 0, result.stderr
    assert hub.sent[f"{repo}/{WEIGHTS}"] == FIRST_RANGE  # the header's first range, once


def test_a_later_lens_downloads_the_whole_file_and_then_nothing_is_fetched(
    hub, wide, tmp_path, cli
):
    """The kept ranges never stand in for the file: lens downloads it whole into the hub cache,
    after which neighbors reads that file and fetches no range."""
    repo = "org/wide-lens"
    hub.add(repo, wide)
    ranged = run(hub.url, tmp_path, "neighbors", repo, "king", "--json")
    assert ranged.returncode == 0, ranged.stderr
    lens = run(hub.url, tmp_path, "lens", repo, "the king", "--json")
    assert lens.returncode == 0, lens.stderr
    assert (_snapshot(tmp_path, repo) / WEIGHTS).read_bytes() == (wide / WEIGHTS).read_bytes()
    gets = len(hub.log)
    whole = run(hub.url, tmp_path, "neighbors", repo, "king", "--json")
    assert whole.returncode == 0, whole.stderr
    assert not [r for r in hub.log[gets:] if r[0] == "GET" and r[2]], hub.log[gets:]
    report = json.loads(whole.stdout)
    assert report["hub_fetched_bytes"] is None
    assert "by range" not in whole.stderr
    same_report(report, json.loads(ranged.stdout))


def test_a_server_that_ignores_range_is_stopped(hub, wide, tmp_path):
    repo = "org/wide-norange"
    hub.add(repo, wide, behaviour=f"norange:{WEIGHTS}")
    err = fails(run(hub.url, tmp_path, "neighbors", repo, "king"))
    assert f"ignored the byte range asked of '{repo}/{WEIGHTS}' (bytes 0-99999)" in err
    assert "began sending the whole file" in err
    assert "hint: check HF_ENDPOINT and your proxy" in err
    ranges = tmp_path / "embedlens" / "ranges"
    assert not _kept_bytes(ranges)


def test_a_cut_range_is_asked_again_then_refused(hub, wide, tmp_path):
    repo = "org/wide-cut"
    hub.add(repo, wide, behaviour=f"cutrange:{WEIGHTS}")
    err = fails(run(hub.url, tmp_path, "neighbors", repo, "king"))
    assert f"the hub's answers for '{repo}/{WEIGHTS}' (bytes 0-99999) were cut off" in err
    gets = [r[2] for r in hub.log if r[0] == "GET" and r[1] == f"/{repo}/resolve/main/{WEIGHTS}"]
    assert gets == ["bytes=0-99999", "bytes=50000-99999", "bytes=75000-99999"], gets
    ranges = tmp_path / "embedlens" / "ranges"
    assert not _kept_bytes(ranges)


def test_offline_without_kept_ranges_names_the_file(hub, wide, tmp_path):
    """The config and tokenizer are in the hub cache, the ranges were kept elsewhere: offline,
    the weights file is named."""
    repo = "org/wide-elsewhere"
    hub.add(repo, wide)
    kept = {"EMBEDLENS_CACHE": str(tmp_path / "own")}
    online = run(hub.url, tmp_path, "neighbors", repo, "king", "--json", env_more=kept)
    assert online.returncode == 0, online.stderr
    assert list((tmp_path / "own").rglob("size"))
    assert not (tmp_path / "embedlens").exists()
    err = fails(run(hub.url, tmp_path, "neighbors", repo, "king", offline=True))
    assert f"error: '{repo}' is not in the local hub cache ({WEIGHTS}) and HF_HUB_OFFLINE" in err
    offline = run(hub.url, tmp_path, "neighbors", repo, "king", offline=True, env_more=kept)
    assert offline.returncode == 0, offline.stderr


def test_sizes_in_the_note():
    assert decimal_size(311_164_928) == "311 MB"
    assert decimal_size(1_503_300_328) == "1.5 GB"
    assert decimal_size(999) == "999 bytes"
    assert decimal_size(9_216) == "9.22 KB"


def test_the_note_says_what_was_fetched_and_what_was_kept():
    tally = Tally(files={"a.safetensors": 1_503_300_328}, data={"a.safetensors": 311_164_928})
    tally.data_fetched = {"a.safetensors": 311_164_928}
    assert tally.notes() == ["read 311 MB of a.safetensors (1.5 GB) by range"]
    tally.data_fetched = {}
    assert tally.notes() == [
        "read 311 MB of a.safetensors (1.5 GB) by range, kept from an earlier run (nothing fetched)"
    ]
    tally.data_fetched = {"a.safetensors": 2048}
    assert tally.notes() == [
        "read 311 MB of a.safetensors (1.5 GB) by range (2.05 KB fetched, the rest kept from an "
        "earlier run)"
    ]
