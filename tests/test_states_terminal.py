"""lens --save-states and --states on a terminal (a pseudo-terminal of 100 columns, as a user's
shell gives, where rich draws its live status): no progress bar of transformers' ("Loading
weights") is drawn, and the self-check note reads whole."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="a pseudo-terminal is POSIX's")

PROMPT = "the king of France is"


def on_terminal(*args: str | Path, cwd: Path) -> str:
    """`embedlens ARGS` with stdin, stdout and stderr on one pseudo-terminal; all it wrote there."""
    import fcntl
    import pty
    import struct
    import termios

    main, child = pty.openpty()
    # a terminal of 0 columns (a pty's size until set) has tqdm draw no bar at all
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))
    env = {**os.environ, "COLUMNS": "100", "LINES": "40", "TERM": "xterm-256color"}
    for name in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "embedlens", *map(str, args)]
    proc = subprocess.Popen(cmd, stdin=child, stdout=child, stderr=child, cwd=cwd, env=env)
    os.close(child)
    out = bytearray()
    try:
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the terminal closed (Linux says EIO)
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(main)
        proc.wait(timeout=600)
    assert proc.returncode == 0, out.decode(errors="replace")
    return out.decode(errors="replace")


def test_no_progress_bar_on_a_terminal(tiny, tmp_path):
    """The load that saves the states (in bfloat16: through transformers' from_pretrained, which
    draws 'Loading weights' where bars are on) and the --states decode, each on a terminal: the
    table is drawn as a terminal's (colour), and no bar runs into the notes."""
    folder = tiny("llama-untied")
    saved = tmp_path / "states.safetensors"
    for args in (
        (folder, PROMPT, "--dtype", "bfloat16", "--save-states", saved),
        (folder, "--states", saved, "--dtype", "bfloat16", "--position", "all"),
    ):
        said = on_terminal("lens", *args, cwd=tmp_path)
        assert "\x1b[" in said  # rich saw a terminal
        assert "Loading weights" not in said
        assert "it/s]" not in said  # no other tqdm bar either
    plain = " ".join(said.replace("\r", "").split())
    assert "self-check made: block 3's output decoded at the last position" in plain
