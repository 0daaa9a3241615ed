"""The same input gives the same bytes beside other processes' load; on one thread or on every
core, the same figures within float32 rounding (TOLERANCE).

The lens picks its thread count from the work's size alone, never from the machine's load: a busy
machine runs it as a quiet one does, byte for byte. A thread count set by hand can move the last
bits of float32 figures: a BLAS may split a matrix product's sums between threads (MKL does on an
Intel CPU with AVX-512, for SmolLM2's MLP output on a batch of 128 rows), so byte-identity holds
for one machine and one thread count, and across thread counts the figures agree within TOLERANCE.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.busy import busy_processes

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-4
"""How far a float32 figure may move with the thread count: relative, and absolute below 1
(README's promise; 1.6e-5 seen on an Intel CPU with AVX-512, probabilities and log-probabilities
of the rows after a product split by threads). Ids, tokens, counts and flags are exact."""
# Runs the CLI with torch's thread count forced: 1, or N (small work runs on one thread by design,
# and there the forward pass itself would follow the thread count: a 7-token product is split by
# its sum).
_FORCED = """\
import sys
import torch
threads = int(sys.argv[1])
print(f"torch threads: {torch.get_num_threads()}", file=sys.stderr)
if threads:
    torch.set_num_threads(threads)
from embedlens.cli import main
sys.argv = ["embedlens", *sys.argv[2:]]
main()
"""


def _forty_prompts() -> str:
    """40 prompts of 6 to 20 tokens: batches of several lengths, padded on the right."""
    places = ["France", "Germany", "Italy", "Spain", "Japan", "Canada", "Brazil", "Egypt", "India"]
    forms = [
        "The capital of {} is",
        "In {} people usually speak",
        "The most famous food from {} is probably the",
        "Last summer we travelled across {} by train, and the first city we saw was",
    ]
    lines = [{"prompt": f.format(p), "id": f"{i}-{p}"} for i, f in enumerate(forms) for p in places]
    lines += [{"prompt": "Water freezes at zero degrees", "target": " Celsius"}] * 4
    return "".join(json.dumps(line) + "\n" for line in lines)


_STORY = (
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "woodcutter and his wife. Every morning he walked into the forest with his axe, and every "
    "evening he came home with wood for the fire. One day he met"
)


def _run(argv: list[str], threads: int = 0) -> bytes:
    return _run_on(argv, threads)[0]


def _run_on(argv: list[str], threads: int = 0) -> tuple[bytes, int]:
    """stdout, and torch's own thread count in that process (before any is set by hand), run as
    a user's process is: without the test worker's share of the cores (OMP_NUM_THREADS)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    result = subprocess.run(
        [sys.executable, "-c", _FORCED, str(threads), *argv], capture_output=True, cwd=ROOT, env=env
    )
    assert result.returncode == 0, result.stderr.decode()
    said = [ln for ln in result.stderr.decode().splitlines() if ln.startswith("torch threads: ")]
    return result.stdout, int(said[0].removeprefix("torch threads: "))


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two JSON values differ: floats by more than TOLERANCE (relative, absolute below 1),
    anything else at all."""
    if isinstance(a, float) and isinstance(b, float):
        close = abs(a - b) <= TOLERANCE * max(1.0, abs(a), abs(b))
        return [] if close else [f"{where}: {a!r} != {b!r}"]
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in differences(x, y, f"{where}[{i}]")]
    return [] if type(a) is type(b) and a == b else [f"{where}: {a!r} != {b!r}"]


def _lines(out: bytes) -> list[Any]:
    return [json.loads(line) for line in out.splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("prompts", ["forty", "one"])
def test_lens_json_is_the_same_whatever_the_load_and_close_whatever_the_threads(
    prompts, smollm2, tmp_path
):
    """Beside 3 busy processes: the same bytes. On one thread and on every core (torch's count
    set by hand, unless torch's own count is every core's: then the run as it is is that run):
    every id, token, count and flag the same, every float within TOLERANCE."""
    if prompts == "one":  # 55 tokens, every position: large work, one row's sums on its own
        argv = ["lens", str(smollm2), _STORY, "--position", "all", "--json"]
    else:
        text = _forty_prompts()
        assert len(text.splitlines()) == 40
        (tmp_path / "prompts.jsonl").write_text(text, encoding="utf-8")
        argv = ["lens", str(smollm2), "--prompts", str(tmp_path / "prompts.jsonl"), "--json"]
    argv.append("--quiet")
    as_it_is, own = _run_on(argv)
    with busy_processes(3):
        busy = _run(argv)
    every = os.cpu_count() or 1
    one_thread = _run(argv, 1)
    # where torch's own count is every core's, the run as it is was that run (the same setting)
    every_thread = as_it_is if own == every else _run(argv, every)
    assert as_it_is.count(b"\n") >= (1 if prompts == "one" else 7)
    assert busy == as_it_is, "3 busy processes beside the run changed its output"
    assert differences(_lines(one_thread), _lines(as_it_is))[:5] == [], "one thread"
    assert differences(_lines(every_thread), _lines(as_it_is))[:5] == [], "every core's thread"


def test_differences_hold_floats_to_the_tolerance_and_the_rest_to_equality():
    """The comparison above: a float within TOLERANCE is the same, past it not; an id, a
    token, a flag or a length that differs is a difference."""
    row = {"id": 3, "token": " Paris", "prob": 0.5, "kl": 99.53, "ok": True, "top": [1, 2]}
    assert differences(row, {**row, "prob": 0.5 + 0.9e-4, "kl": 99.53 * (1 + 0.9e-4)}) == []
    assert differences(row, {**row, "prob": 0.5 + 1.1e-4}) == [".prob: 0.5 != 0.50011"]
    assert differences(row, {**row, "kl": 99.53 * (1 + 1.1e-4)}) != []
    for changed in ({"id": 4}, {"token": " paris"}, {"ok": False}, {"top": [2, 1]}, {"top": [1]}):
        assert differences(row, {**row, **changed}) != [], changed
    assert differences([row], [row, row]) != [] and differences(row, {"id": 3}) != []
    assert differences(1, 1.0) != []  # an integer stays one


def test_busy_processes_keep_the_cores_busy():
    """The load the test above and CI's busy run make is real: other processes' CPU time."""
    from tests.busy import OthersBusy

    if not Path("/proc/stat").exists():
        pytest.skip("needs /proc/stat")
    others = OthersBusy()
    with busy_processes(2) as spinning:
        others()
        subprocess.run([sys.executable, "-c", "import time; time.sleep(0.5)"], check=True)
        assert others() > 1.0
        assert all(p.poll() is None for p in spinning)
    assert all(p.poll() is not None for p in spinning)
