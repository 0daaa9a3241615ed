"""Ctrl-C and closed pipes, in real processes: exit 130 or 0, and nothing on stderr."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import release_note


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "EMBEDLENS_DEBUG"}
    env["HF_HUB_OFFLINE"] = "1"
    return env


def _wait_for_library(pid: int, marker: str, limit_s: float = 120.0) -> bool:
    """Wait until the process has mapped a shared library (it is then inside the command)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            return False
        if marker in maps:
            return True
        time.sleep(0.02)
    return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
@pytest.mark.parametrize(
    ("args", "marker"),
    [
        (("lens", "{tiny}", "the king"), "libtorch"),
        (("tied", "{tiny}", "--load"), "libtorch"),
        (("neighbors", "{smol}", "king", "-k", "20"), "_multiarray_umath"),
    ],
)
def test_ctrl_c_exits_130_quietly(tiny, smollm2, args, marker):
    argv = [a.format(tiny=tiny("llama-tied"), smol=smollm2) for a in args]
    proc = subprocess.Popen(
        [sys.executable, "-m", "embedlens", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        # Python raises KeyboardInterrupt only where SIGINT was not ignored at start, and a shell
        # ignores it in its background jobs: the child starts with the default disposition.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert _wait_for_library(proc.pid, marker), "the command never got going"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (proc.returncode, out, err) == (130, "", "")


@pytest.mark.parametrize(
    "args",
    [
        ("params", "{tiny}", "--json"),
        ("params", "{tiny}", "--per-block"),
        ("tied", "{smol}"),
        ("neighbors", "{smol}", "king", "-k", "500", "--json"),
        ("addr", "{tiny}", "3", "4"),
        ("lens", "{tiny}", "the king", "--json"),
    ],
)
def test_a_closed_pipe_ends_quietly(tiny, smollm2, args):
    """stdout is a pipe whose reader is gone before the first write (`| head -c 0`, at once)."""
    argv = [a.format(tiny=tiny("llama-tied"), smol=smollm2) for a in args]
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "embedlens", *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)
    said = [line for line in result.stderr.splitlines() if not release_note(line)]
    assert (result.returncode, said) == (0, []), result.stderr


def test_head_in_a_shell_pipeline(smollm2):
    """The issue's own example, through a shell: `embedlens ... --json | head -c 10`."""
    script = (
        f"set -o pipefail; {sys.executable} -m embedlens neighbors '{smollm2}' king -k 2000 "
        "--json | head -c 10"
    )
    result = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, env=_env(), timeout=120
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, '{"schema_v', "")
