"""Memory pre-flight: estimates from headers, available memory, refusals before any weight is read."""

from __future__ import annotations

import pytest

from embedlens.errors import ResourceError, UsageError
from embedlens.io.source import resolve
from embedlens.model import preflight
from embedlens.model.files import check_source


@pytest.mark.parametrize(
    ("text", "value"),
    [("123", 123), ("1kb", 1000), ("1 KiB", 1024), ("1.5GiB", 3 << 29), ("2G", 2 << 30),
     ("8GB", 8 * 10**9), ("1e9", 10**9), ("512MiB", 512 << 20)],
)  # fmt: skip
def test_parse_size(text, value):
    assert preflight.parse_size(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-1GB", "1 XB", "GB"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError):
        preflight.parse_size(text)


def test_meminfo():
    text = "MemTotal:       24683656 kB\nMemFree:  100 kB\nMemAvailable:   23755600 kB\n"
    assert preflight.meminfo_available(text) == 23755600 * 1024
    assert preflight.meminfo_available("MemTotal: 5 kB\n") is None


def test_cgroup_headroom(tmp_path):
    assert preflight.cgroup_headroom(tmp_path) is None  # no cgroup files
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("1000\n")
    assert preflight.cgroup_headroom(tmp_path) is None  # no limit
    (tmp_path / "memory.max").write_text("4096\n")
    assert preflight.cgroup_headroom(tmp_path) == 3096
    (tmp_path / "memory.current").write_text("5000\n")
    assert preflight.cgroup_headroom(tmp_path) == 0
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # unlimited
    (v1 / "memory" / "memory.usage_in_bytes").write_text("10\n")
    assert preflight.cgroup_headroom(v1) is None
    (v1 / "memory" / "memory.limit_in_bytes").write_text("110\n")
    assert preflight.cgroup_headroom(v1) == 100


def test_host_memory_is_read_here():
    """On Linux, /proc/meminfo is there: the figure is positive and below the machine's total."""
    found = preflight.host_memory_available()
    assert found is not None and found > 0
    with open("/proc/meminfo") as fh:
        total = int(fh.readline().split()[1]) * 1024
    assert found <= total


def test_override(monkeypatch):
    monkeypatch.setenv(preflight.MEMORY_LIMIT_ENV, "2GiB")
    assert preflight.available("cpu") == (2 << 30, "memory")
    assert preflight.available("cuda:1") == (2 << 30, "GPU memory on cuda:1")
    monkeypatch.setenv(preflight.MEMORY_LIMIT_ENV, "plenty")
    with pytest.raises(UsageError, match="is not a size"):
        preflight.available("cpu")


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def test_estimate_from_safetensors_headers(tiny):
    from embedlens.io.checkpoint import open_checkpoint

    source = resolve(str(tiny("llama-untied")))
    ckpt = open_checkpoint(source)
    numel = sum(_numel(t.shape) for t in ckpt.tensors.values())
    largest = max(_numel(t.shape) for t in ckpt.tensors.values())
    assert {t.dtype for t in ckpt.tensors.values()} == {"F32"}
    auto = preflight.estimate(source, "auto")
    assert (auto.weights, auto.largest) == (4 * numel, 4 * largest)
    half = preflight.estimate(source, "bfloat16")
    assert (half.weights, half.largest, half.dtype) == (2 * numel, 2 * largest, "bfloat16")
    assert auto.needed == auto.weights + auto.largest


def test_estimate_follows_the_config_dtype(tiny, tmp_path):
    import json
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny("llama-tied"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config))
    stored = preflight.estimate(resolve(str(tiny("llama-tied"))), "auto")
    est = preflight.estimate(resolve(str(folder)), "auto")
    assert est.dtype == "bfloat16" and est.weights * 2 == stored.weights


def test_estimate_of_a_gguf_is_dequantised_float32(smollm2):
    est = preflight.estimate(resolve(str(smollm2)), "auto")
    assert est.weights == 4 * 134_515_008 and est.dtype == "float32"
    assert preflight.estimate(resolve(str(smollm2)), "float16").weights == 2 * 134_515_008


def test_estimate_unknown_when_there_are_no_headers(tmp_path):
    from tests.models import write_config

    folder = write_config(tmp_path / "cfg", {"model_type": "llama", "vocab_size": 10})
    assert preflight.estimate(resolve(str(folder)), "auto") is None


def test_check_load(tiny, monkeypatch):
    source = check_source(resolve(str(tiny("llama-tied"))))
    monkeypatch.setenv(preflight.MEMORY_LIMIT_ENV, "1GiB")
    assert preflight.check_load(source, dtype="auto", device="cpu") is not None
    assert preflight.check_load(source, dtype="auto", device=None) is None  # --device-map
    monkeypatch.setenv(preflight.MEMORY_LIMIT_ENV, "10KB")
    with pytest.raises(ResourceError) as info:
        preflight.check_load(source, dtype="auto", device="cpu")
    assert "needs about" in info.value.message and "but only 9.77 KiB is available" in (
        info.value.message
    )
    assert "--dtype bfloat16" in info.value.hint and "--meta-only" in info.value.hint
    with pytest.raises(ResourceError) as info:
        preflight.check_load(source, dtype="bfloat16", device="cpu")
    assert "--dtype bfloat16" not in info.value.hint and "--device-map auto" in info.value.hint


@pytest.fixture
def no_real_load(monkeypatch):
    """Make transformers' from_pretrained fail loudly: a refusal must come before it."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("from_pretrained was called")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


@pytest.mark.parametrize(
    "args",
    [
        ("params", "--load"),
        ("tied", "--load"),
        ("lens", "the king"),
    ],
)
def test_commands_refuse_before_loading(cli, tiny, no_real_load, args):
    command, *rest = args
    err = cli.fails(
        command, tiny("llama-tied"), *rest, code=1, env={preflight.MEMORY_LIMIT_ENV: "50KB"}
    )
    assert "error: loading '" in err and "needs about" in err and "of memory" in err
    assert "hint: try --dtype bfloat16" in err


def test_a_bad_override_is_a_usage_error(cli, tiny):
    err = cli.fails(
        "params", tiny("llama-tied"), "--load", code=2, env={preflight.MEMORY_LIMIT_ENV: "huge"}
    )
    assert "EMBEDLENS_MEMORY_LIMIT='huge' is not a size" in err


def test_a_load_that_fits_goes_ahead(cli, tiny):
    data = cli.json("params", tiny("llama-tied"), "--load", env={preflight.MEMORY_LIMIT_ENV: "1GB"})
    assert data["source"] == "weights"
