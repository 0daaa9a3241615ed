"""Each public function leaves the caller's process as it found it (`embedlens.guest`):
environment variables, log levels, progress bars, the garbage collector's thresholds and
torch's threads, on return and on error.

Before each call the state is moved off every default (so a call that sets a default back, or
silences what was loud, is seen), then read again after the call."""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import embedlens
from embedlens import guest

LOGGERS = ("", "transformers", "huggingface_hub", "accelerate", "transformers.modeling_utils")


def state() -> dict[str, Any]:
    """What a call must leave as it was."""
    import torch
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging as hf_logging

    return {
        "environ": {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"},
        "levels": {name: logging.getLogger(name).level for name in LOGGERS},
        "every level": {
            name: logger.level
            for name, logger in logging.Logger.manager.loggerDict.items()
            if isinstance(logger, logging.Logger)
        },
        "transformers verbosity": hf_logging.get_verbosity(),
        "transformers bars": hf_logging.is_progress_bar_enabled(),
        "hub bars off": are_progress_bars_disabled(),
        "gc": (gc.get_threshold(), gc.isenabled()),
        "torch threads": (torch.get_num_threads(), torch.get_num_interop_threads()),
    }


@pytest.fixture
def caller() -> Iterator[dict[str, Any]]:
    """A caller's process off the defaults: transformers at INFO with its bars on, the hub's
    bars on, odd gc thresholds, torch on three threads, a variable of its own; all set back
    after the test."""
    import torch
    from huggingface_hub.utils import enable_progress_bars
    from transformers.utils import logging as hf_logging

    # the library is imported first (its loggers exist), as a caller's session would have it
    before = (hf_logging.get_verbosity(), gc.get_threshold(), torch.get_num_threads())
    hf_logging.set_verbosity_info()
    hf_logging.enable_progress_bar()
    enable_progress_bars()
    gc.set_threshold(1234, 11, 12)
    torch.set_num_threads(3)
    os.environ["EMBEDLENS_GUEST_TEST"] = "mine"
    try:
        yield state()
    finally:
        os.environ.pop("EMBEDLENS_GUEST_TEST", None)
        hf_logging.set_verbosity(before[0])
        gc.set_threshold(*before[1])
        torch.set_num_threads(before[2])


def same(after: dict[str, Any], before: dict[str, Any]) -> None:
    """`after` is `before` (loggers made during the call apart: they had no level before)."""
    levels = before["every level"]
    after = {**after, "every level": {k: after["every level"].get(k) for k in levels}}
    changed = {
        key: {k: (v, after[key].get(k)) for k, v in value.items() if after[key].get(k) != v}
        if isinstance(value, dict)
        else (value, after[key])
        for key, value in before.items()
        if after[key] != value
    }
    added = set(after["environ"]) - set(before["environ"])
    assert not changed and not added, (changed, added)


def _states(tmp_path: Path) -> Path:
    """States saved by the tiny model (saved in the fixture `states`, before the call)."""
    return tmp_path / "states.safetensors"


def _words(tmp_path: Path) -> Path:
    from tests.test_tune import words_file

    return words_file(tmp_path / "words.txt")


CALLS: dict[str, Callable[[Path, Path], Any]] = {
    "params": lambda m, _: embedlens.params(m, load=True),
    "tied": lambda m, _: embedlens.tied(m, load=True),
    "neighbors": lambda m, _: embedlens.neighbors(m, ["king"], top_k=3),
    "addr": lambda m, _: embedlens.addr(m, [42]),
    "vocab": lambda m, _: embedlens.vocab(m),
    "lens": lambda m, _: embedlens.lens(m, "Hello world", top_k=2),
    "lens_prompts": lambda m, _: embedlens.lens_prompts(m, ["Hello world", "the king"], top_k=2),
    "lens_states": lambda m, t: embedlens.lens_states(m, _states(t)),
    "lens_text": lambda m, t: embedlens.lens_text(m, _words(t), ctx=16),
    "lens_parity": lambda m, t: embedlens.lens_parity(m, "Hello world", against_dtype="bfloat16"),
    "tune": lambda m, t: embedlens.tune(
        m, _words(t), t / "lens", tokens=512, eval_tokens=128, method="affine"
    ),
}


def test_every_public_function_is_here():
    assert set(CALLS) == {n for n in embedlens.__all__ if n.islower() and not n.startswith("_")}


@pytest.fixture
def states(tiny: Callable[[str], Path], tmp_path: Path) -> None:
    """The tiny model's states saved where `lens_states` reads them (before `caller`)."""
    embedlens.lens(tiny("llama-tied"), "Hello world", save_states=_states(tmp_path))


@pytest.mark.parametrize("command", sorted(CALLS))
def test_a_call_leaves_the_process_as_it_found_it(command, tiny, tmp_path, states, caller):
    CALLS[command](tiny("llama-tied"), tmp_path)
    same(state(), caller)


@pytest.mark.parametrize("command", sorted(CALLS))
def test_a_call_that_fails_leaves_it_too(command, tiny, tmp_path, states, caller):
    """A model whose weights are cut short: each function fails where it first reads them."""
    import shutil

    from embedlens.errors import EmbedlensError

    folder = tmp_path / "cut"
    shutil.copytree(tiny("llama-tied"), folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4096])
    with pytest.raises(EmbedlensError):
        CALLS[command](folder, tmp_path)
    same(state(), caller)


def test_a_failure_after_the_model_is_read_leaves_it_too(tiny, caller):
    def fail(*_: object) -> None:
        raise RuntimeError("the caller's own error")

    with pytest.raises(RuntimeError, match="the caller's own error"):
        embedlens.lens_prompts(tiny("llama-tied"), ["Hello world", "the king"], on_report=fail)
    same(state(), caller)


def test_what_a_guest_block_changes_is_put_back_on_error(caller):
    """The control: everything the snapshot covers, changed inside a block that raises."""
    import torch
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    with pytest.raises(ValueError), guest.guest():
        guest.quietly_kept()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        disable_progress_bars()
        logging.getLogger("accelerate").setLevel(logging.ERROR)
        os.environ["OPENBLAS_NUM_THREADS"] = "1"
        os.environ["EMBEDLENS_GUEST_TEST"] = "changed"
        gc.set_threshold(5, 5, 5)
        gc.disable()
        torch.set_num_threads(1)
        assert state() != caller
        raise ValueError
    assert state() == caller


def test_the_command_line_keeps_its_quiet():
    """Outside a guest call (the command line owns its process) nothing is recorded."""
    kept: list[int] = []
    guest.keep(lambda: kept.append(1))
    with guest.guest():
        guest.keep(lambda: kept.append(2))
    assert kept == [2]


def test_blocks_open_at_once_in_threads_put_it_back_when_the_last_ends():
    """Two threads in guest blocks at once: the first to end does not put the process back
    under the other (which still sees the changes both made), and the last puts back what the
    first found; what either recorded with `keep` runs then, once."""
    import threading

    kept: list[str] = []
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, str | None] = {}

    def first() -> None:
        with guest.guest():
            os.environ["EMBEDLENS_GUEST_A"] = "a"
            guest.keep(lambda: kept.append("a"))
            first_in.set()
            second_in.wait(30)
        first_out.set()

    def second() -> None:
        first_in.wait(30)
        with guest.guest():
            os.environ["EMBEDLENS_GUEST_B"] = "b"
            guest.keep(lambda: kept.append("b"))
            second_in.set()
            first_out.wait(30)
            seen.update(
                a=os.environ.get("EMBEDLENS_GUEST_A"), b=os.environ.get("EMBEDLENS_GUEST_B")
            )
            seen["kept"] = ",".join(kept)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert seen == {"a": "a", "b": "b", "kept": ""}
    assert "EMBEDLENS_GUEST_A" not in os.environ and "EMBEDLENS_GUEST_B" not in os.environ
    assert kept == ["b", "a"]
