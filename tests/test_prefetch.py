"""A folder's bfloat16 and float16 weights copied to float32 on a second thread while the model is
built (embedlens.compat.transformers.direct): the model the lens loads is still transformers' own, bit for
bit, the copies are the ones the load uses, and no thread or copy outlives a load that stops.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from embedlens.compat.transformers import direct
from embedlens.compat.transformers.direct import Prefetch
from embedlens.errors import CheckpointError
from embedlens.io.source import resolve
from embedlens.model import loading
from tests.test_direct_load import assert_same_model, reference


def halved(tiny: Any, tmp: Path, family: str, dtype: str, **kwargs: Any) -> Path:
    """The tiny model of `family` with its floating tensors saved in `dtype` (a hub download's
    usual form); integer tensors left as they are."""
    import torch
    from safetensors.torch import load_file, save_file

    folder = tmp / f"{family}-{dtype}"
    shutil.copytree(tiny(family, **kwargs), folder)
    for path in sorted(folder.glob("*.safetensors")):
        tensors = load_file(path)
        wanted = getattr(torch, dtype)
        save_file(
            {k: v.to(wanted) if v.is_floating_point() else v for k, v in tensors.items()},
            path,
            metadata={"format": "pt"},
        )
    return folder


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "embedlens-prefetch"]


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys whose float32 copy the load took from the prefetch (on a machine of two cores
    or more, as the one that runs the tests may not be)."""
    keys: list[str] = []
    monkeypatch.setattr(direct, "worth_it", lambda: True)
    original = Prefetch.take

    def counted(self: Prefetch, path: Path, key: str, dtype: Any) -> Any:
        value = original(self, path, key, dtype)
        if value is not None:
            keys.append(key)
        return value

    monkeypatch.setattr(Prefetch, "take", counted)
    return keys


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    "family", ["llama-tied", "llama-untied", "qwen3", "gpt2", "gemma2", "phi3"]
)
def test_the_prefetched_model_is_transformers_own(tiny, tmp_path, taken, family, dtype):
    folder = halved(tiny, tmp_path, family, dtype)
    model = loading.load_model(resolve(str(folder)), dtype="float32")
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        stored = set(handle.keys())
    assert sorted(taken) == sorted(stored)  # every weight's float32 copy is the thread's
    assert_same_model(model, reference(folder, direct.read_config(folder))[0])
    assert not prefetch_threads()


def test_shards_are_prefetched_too(tiny, tmp_path, taken):
    folder = halved(tiny, tmp_path, "llama-untied", "bfloat16", max_shard_size="20KB")
    assert len(list(folder.glob("*.safetensors"))) > 1
    model = loading.load_model(resolve(str(folder)), dtype="float32")
    assert len(taken) == len(set(taken)) == len(model.state_dict())
    assert_same_model(model, reference(folder, direct.read_config(folder))[0])


@pytest.mark.parametrize("path", ["batched", "public"])
def test_a_copy_is_the_conversion_itself(tmp_path, monkeypatch, path):
    """Every bfloat16 and float16 value, special ones included, copied as Tensor.to makes it:
    by torch's private batched copy, and by the public copy_ on a torch it was not checked on."""
    import torch

    if path == "public":
        from embedlens.compat import torch as compat_torch

        monkeypatch.setattr(compat_torch, "TORCH_CHECKED", ((0, 0), (0, 1)))

        def refused(*args: object) -> None:
            raise AssertionError("the private batched copy was taken")

        monkeypatch.setattr(torch, "_foreach_copy_", refused)
    from safetensors.torch import save_file

    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    tensors = {
        "b": bits.view(torch.bfloat16).reshape(256, 256),
        "h": bits.clone().view(torch.float16).reshape(256, 256),
        "f": torch.arange(6, dtype=torch.float32),
        "i": torch.arange(6, dtype=torch.int64),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    early = Prefetch([path])
    try:
        for key in ("b", "h"):
            got = early.take(path, key, torch.float32)
            want = tensors[key].to(torch.float32)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), key
        # float32 and integer tensors are read by the load itself, as is another wanted dtype
        assert early.take(path, "f", torch.float32) is None
        assert early.take(path, "i", torch.int64) is None
    finally:
        early.close()
    assert not prefetch_threads()


def test_the_thread_copies_in_pieces_and_never_sets_torchs_thread_count(tmp_path, monkeypatch):
    """torch's thread count is process-wide, the main thread's to set: the copies run in pieces
    torch keeps on the calling thread, and nothing on the prefetch thread sets it. A tensor of
    several calls and a tail, and one smaller than a piece: the bits of Tensor.to."""
    import torch
    from safetensors.torch import save_file

    setting: list[str] = []
    original = torch.set_num_threads

    def recorded(n: int) -> None:
        setting.append(threading.current_thread().name)
        original(n)

    monkeypatch.setattr(torch, "set_num_threads", recorded)
    n = direct.PIECE * direct.PER_CALL * 2 + 12345
    seed = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**15), 2**15, (n,), generator=seed, dtype=torch.int32).to(torch.int16)
    tensors = {"b": bits.view(torch.bfloat16), "h": bits[:777].clone().view(torch.float16)}
    tensors["h"] = tensors["h"].reshape(7, 111)
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    early = Prefetch([path])
    try:
        for key in ("b", "h"):
            got = early.take(path, key, torch.float32)
            want = tensors[key].to(torch.float32)
            assert got.shape == want.shape
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), key
    finally:
        early.close()
    assert setting == []
    assert not prefetch_threads()


def test_a_refused_load_leaves_no_thread_and_no_copy(tiny, tmp_path, taken):
    """A checkpoint that lacks a weight is refused with the copies begun: the thread has ended and
    nothing was taken."""
    from safetensors.torch import load_file, save_file

    folder = halved(tiny, tmp_path, "llama-untied", "bfloat16")
    tensors = load_file(folder / "model.safetensors")
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="lacks 1 of the model's weights"):
        loading.load_model(resolve(str(folder)), dtype="float32")
    assert not prefetch_threads()


def test_a_converted_checkpoint_goes_to_transformers_with_the_copies_let_go(
    tiny, tmp_path, taken, monkeypatch
):
    """Qwen3-MoE's experts are merged as transformers loads them: from_pretrained loads it, after
    the prefetch is closed (two float32 copies of the weights are never held)."""
    from transformers import AutoModelForCausalLM

    closed: list[bool] = []
    original_close = Prefetch.close
    original = AutoModelForCausalLM.from_pretrained

    def close(self: Prefetch) -> None:
        original_close(self)
        closed.append(True)

    def counted(*args: Any, **kwargs: Any) -> Any:
        assert closed and not prefetch_threads()
        return original(*args, **kwargs)

    monkeypatch.setattr(Prefetch, "close", close)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", counted)
    folder = halved(tiny, tmp_path, "qwen3-moe", "bfloat16")
    model = loading.load_model(resolve(str(folder)), dtype="float32")
    assert taken == []
    assert_same_model(model, reference(folder, direct.read_config(folder))[0])


def test_a_broken_file_is_reported_as_without_the_prefetch(tiny, tmp_path):
    """A safetensors header the prefetch cannot read: the load says what it says without it."""
    folder = halved(tiny, tmp_path, "llama-tied", "bfloat16")
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError) as caught:
        loading.load_model(resolve(str(folder)), dtype="float32")
    assert "model.safetensors" in caught.value.message or str(folder) in caught.value.message
    assert not prefetch_threads()


def test_on_one_core_the_load_reads_the_tensors_itself(tiny, tmp_path, taken, monkeypatch):
    """One core: no second thread (the copies would only take turns with the imports)."""
    monkeypatch.setattr(direct, "worth_it", lambda: False)
    folder = halved(tiny, tmp_path, "llama-tied", "bfloat16")
    model = loading.load_model(resolve(str(folder)), dtype="float32")
    assert taken == []
    assert_same_model(model, reference(folder, direct.read_config(folder))[0])


def test_worth_it_follows_the_cores_this_process_may_use(monkeypatch):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0})
    assert not direct.worth_it()
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    assert direct.worth_it()
