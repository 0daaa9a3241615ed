"""A GGUF file on the hub (`REPO:FILE.gguf`): its header read by growing ranges, then only the
tensor (or rows) a command reads.

Against the local stand-in for the hub (tests.hubserver), serving the real SmolLM2 GGUF (98 MB;
a 1.8 MB header with its 49k-token vocabulary and merges, then a 30 MB Q8_0 embedding).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from embedlens.io.gguf import HeaderShort, parse_gguf_start, read_gguf_header
from embedlens.io.hub_gguf import FIRST_RANGE, split_spec
from embedlens.io.ranges import decimal_size
from tests.hubserver import COMMIT, FakeHub, Repo
from tests.test_hub_failures import fails, run
from tests.test_hub_ranges import reruns_offline, same_report

ARGS = {
    "neighbors": [" king", "' king' - ' man' + ' woman'"],
    "addr": ["42", " king"],
    "vocab": [],
}


SOURCE = "org/smol"


@pytest.fixture(scope="module")
def hub(smollm2: Path):
    """The stand-in hub serving SmolLM2's GGUF as SOURCE (and, through `_serve`, as repos of
    each test's own, sharing its one copy in memory)."""
    with FakeHub(lifetime_s=900) as server:
        server.repos[SOURCE] = Repo("ok", {smollm2.name: smollm2.read_bytes()})
        yield server


def _serve(hub: FakeHub, repo: str) -> str:
    """Serve SmolLM2's GGUF as repo; MODEL naming it."""
    files = hub.repos[SOURCE].files
    hub.repos[repo] = Repo("ok", files)
    return f"{repo}:{next(iter(files))}"


def _sent(hub: FakeHub, repo: str) -> dict[str, int]:
    return {k.split("/", 2)[2]: v for k, v in hub.sent.items() if k.startswith(repo + "/")}


def _big_files(hf_home: Path) -> list[Path]:
    """Files of the hub cache over 100 KB (a GGUF, whole or in part)."""
    return [p for p in (hf_home / "hub").rglob("*") if p.is_file() and p.stat().st_size > 1e5]


@pytest.mark.parametrize("command", ["neighbors", "addr", "vocab"])
def test_a_command_fetches_the_header_and_the_tensor_alone(hub, smollm2, tmp_path, cli, command):
    repo = f"org/smol-{command}"
    model = _serve(hub, repo)
    args = [command, model, *ARGS[command], "--json"]
    online = run(hub.url, tmp_path, *args)
    assert online.returncode == 0, online.stderr
    header = read_gguf_header(smollm2)
    embed = header.tensors["token_embd.weight"]
    read = embed.nbytes if command != "addr" else 2 * embed.row_bytes
    size = smollm2.stat().st_size
    note = f"note: read {decimal_size(read)} of {smollm2.name} ({decimal_size(size)}) by range"
    assert note in online.stderr
    sent = _sent(hub, repo)
    assert list(sent) == [smollm2.name], sent  # no config.json, no tokenizer: the GGUF alone
    # The header by growing ranges (1 MiB, then 2 MiB in all: its 1.8 MB), then the tensor.
    assert sent[smollm2.name] <= header.data_offset + FIRST_RANGE + read, (sent, read)
    # (addr's row 42 lies in the header's second range: it is read from there, not fetched)
    assert sent[smollm2.name] == 2 * FIRST_RANGE + (read if command != "addr" else read // 2)
    report = json.loads(online.stdout)
    assert report["hub_fetched_bytes"] == sent[smollm2.name]
    local = cli.json(command, smollm2, *ARGS[command])
    same_report(dict(report), local)
    assert not _big_files(tmp_path)  # nothing partial in the hub cache
    reruns_offline(hub, tmp_path, args, online.stdout)


def test_the_header_grows_by_doubling_and_the_tensor_comes_in_one_request(hub, smollm2, tmp_path):
    repo = "org/smol-requests"
    model = _serve(hub, repo)
    result = run(hub.url, tmp_path, "neighbors", model, " king", "--json")
    assert result.returncode == 0, result.stderr
    embed = read_gguf_header(smollm2).tensors["token_embd.weight"]
    gets = [r[2] for r in hub.log if r[0] == "GET" and r[1].startswith(f"/{repo}/")]
    first, last = embed.offset, embed.offset + embed.nbytes - 1
    assert gets == [
        f"bytes=0-{FIRST_RANGE - 1}",
        f"bytes={FIRST_RANGE}-{2 * FIRST_RANGE - 1}",
        f"bytes={first}-{last}",
    ], gets


def test_params_and_tied_read_the_header_alone(hub, smollm2, tmp_path, cli):
    repo = "org/smol-headers"
    model = _serve(hub, repo)
    for command in ("params", "tied"):
        result = run(hub.url, tmp_path, command, model, "--json")
        assert result.returncode == 0, result.stderr
        same_report(json.loads(result.stdout), cli.json(command, smollm2))
    assert _sent(hub, repo) == {smollm2.name: 2 * FIRST_RANGE}  # the header's ranges, once


def test_a_later_lens_downloads_the_whole_file_and_then_nothing_is_fetched(
    hub, smollm2, tmp_path, cli
):
    """The sparse copy never stands in for the file where the model is loaded: lens downloads
    it whole into the hub cache, after which neighbors reads that file and fetches no range."""
    repo = "org/smol-lens"
    model = _serve(hub, repo)
    ranged = run(hub.url, tmp_path, "neighbors", model, " king", "--json")
    assert ranged.returncode == 0, ranged.stderr
    hub.sent.clear()
    args = ["The capital of France is", "--layers", "28:"]
    lens = run(hub.url, tmp_path, "lens", model, *args, "--json")
    assert lens.returncode == 0, lens.stderr
    assert _sent(hub, repo) == {smollm2.name: smollm2.stat().st_size}
    snapshot = tmp_path / "hub" / "models--org--smol-lens" / "snapshots" / COMMIT / smollm2.name
    assert snapshot.read_bytes() == smollm2.read_bytes()
    same_report(json.loads(lens.stdout), cli.json("lens", smollm2, *args))
    gets = len(hub.log)
    whole = run(hub.url, tmp_path, "neighbors", model, " king", "--json")
    assert whole.returncode == 0, whole.stderr
    assert not [r for r in hub.log[gets:] if r[0] == "GET"], hub.log[gets:]
    assert json.loads(whole.stdout)["hub_fetched_bytes"] is None
    assert "by range" not in whole.stderr
    same_report(json.loads(whole.stdout), json.loads(ranged.stdout))


def test_hub_gguf_errors_are_one_line(hub, tmp_path):
    model = _serve(hub, "org/smol-errors")
    err = fails(run(hub.url, tmp_path, "params", "org/smol-errors:other.gguf"))
    assert "error: 'org/smol-errors' has no file 'other.gguf'" in err
    err = fails(run(hub.url, tmp_path, "neighbors", model, " king", offline=True))
    assert "error: 'org/smol-errors' is not in the local hub cache (SmolLM2" in err
    hub.repos["org/not-gguf"] = Repo("ok", {"x.gguf": b"not a gguf file at all" * 100})
    err = fails(run(hub.url, tmp_path, "params", "org/not-gguf:x.gguf"))
    assert "error: 'x.gguf' is not a GGUF file" in err
    err = fails(run(hub.url, tmp_path, "params", "org/absent:x.gguf"))
    assert "hub repository 'org/absent' was not found" in err


def test_a_header_cut_anywhere_asks_for_more(smollm2):
    """Any first bytes that end inside the header ask for more, never parse wrong."""
    whole = smollm2.read_bytes()
    size = len(whole)
    header = read_gguf_header(smollm2)
    for stop in (0, 23, 24, 100, 5000, FIRST_RANGE, header.data_offset - 1):
        with pytest.raises(HeaderShort) as e:
            parse_gguf_start(smollm2, whole[:stop], size)
        assert stop < e.value.needed <= header.data_offset
    parsed = parse_gguf_start(smollm2, whole[: header.data_offset], size)
    assert parsed.tensors == header.tensors and parsed.data_offset == header.data_offset


def test_spec_naming_a_gguf_in_a_repo():
    assert split_spec("org/name:model.Q4_K_M.gguf") == ("org/name", "model.Q4_K_M.gguf")
    assert split_spec("org/name:sub/model.GGUF") == ("org/name", "sub/model.GGUF")
    assert split_spec("org/name") is None
    assert split_spec("org/name:model.safetensors") is None
    assert split_spec("org/name:../x.gguf") is None
    assert split_spec("org/name:/x.gguf") is None


def test_a_corrupt_length_is_refused_without_asking_for_more(tmp_path):
    """A key claiming 50 MB (over the 16 MiB strings may take) in a 100 MB file is an error at
    once, not a request for 50 MB more."""
    import struct

    from embedlens.errors import CheckpointError

    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 50_000_000) + b"k" * 100
    with pytest.raises(CheckpointError) as e:
        parse_gguf_start(tmp_path / "x.gguf", head, 100_000_000)
    assert not isinstance(e.value, HeaderShort)
    assert "claims 50000000 bytes" in e.value.message
