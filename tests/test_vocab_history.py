"""vocab's bytes do not depend on what ran before in the process: its sums are its own, not
BLAS's, whose order follows its threads (tests/test_undertrained.py sets them by hand).

Here the other commands run first in this process (numpy and torch imported, BLAS and torch
threads started, memory taken and freed), then vocab's JSON is compared, byte for byte, with
that of a fresh process whose BLAS runs on one thread.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import embedlens


def _fresh(*args: str | Path) -> bytes:
    """`embedlens ARGS` in a new process, its BLAS on one thread."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "COLUMNS": "140"}
    command = [sys.executable, "-m", "embedlens", *map(str, args)]
    result = subprocess.run(command, capture_output=True, env=env, check=False)
    assert result.returncode == 0, result.stderr.decode()
    return result.stdout


def test_vocab_gives_a_fresh_process_bytes_after_the_other_commands(tiny, smollm2, cli):
    model = tiny("llama-untied")
    embedlens.params(model)
    embedlens.tied(model)
    embedlens.neighbors(model, ["the", "king"])
    embedlens.neighbors(smollm2, [" king"])
    embedlens.lens(model, "the king")
    embedlens.lens_prompts(model, ["the king", "a cat sat on the mat"])
    embedlens.vocab(model, show_all=True)
    for source in (smollm2, model):
        here = cli("vocab", source, "--json")
        assert here.exit_code == 0, here.stderr
        assert here.stdout.encode() == _fresh("vocab", source, "--json"), source
