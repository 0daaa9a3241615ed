"""The same input gives the same bytes: beside other processes' load, on one thread or all.

The lens picks its thread count from the work's size alone, never from the machine's load (a
thread count can move the last bits of a batch's forward pass): a busy machine runs it as a
quiet one does, and no figure may move beside other processes' work.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.busy import busy_processes

ROOT = Path(__file__).resolve().parent.parent
# Runs the CLI with torch's thread count forced: 1, or N (small work runs on one thread by design,
# and there the forward pass itself would follow the thread count: a 7-token product is split by
# its sum).
_FORCED = """\
import sys
import torch
threads = int(sys.argv[1])
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
    result = subprocess.run(
        [sys.executable, "-c", _FORCED, str(threads), *argv], capture_output=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr.decode()
    return result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("prompts", ["forty", "one"])
def test_lens_json_is_the_same_whatever_the_load_and_threads(prompts, smollm2, tmp_path):
    if prompts == "one":  # 55 tokens, every position: large work, one row's sums on its own
        argv = ["lens", str(smollm2), _STORY, "--position", "all", "--json"]
    else:
        text = _forty_prompts()
        assert len(text.splitlines()) == 40
        (tmp_path / "prompts.jsonl").write_text(text, encoding="utf-8")
        argv = ["lens", str(smollm2), "--prompts", str(tmp_path / "prompts.jsonl"), "--json"]
    argv.append("--quiet")
    as_it_is = _run(argv)
    with busy_processes(3):
        busy = _run(argv)
    one_thread, every_thread = _run(argv, 1), _run(argv, os.cpu_count() or 1)
    assert as_it_is.count(b"\n") >= (1 if prompts == "one" else 7)
    assert busy == as_it_is, "3 busy processes beside the run changed its output"
    assert one_thread == as_it_is, "one thread changed the output"
    assert every_thread == as_it_is, "every core's thread changed the output"


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
