"""A scratch folder of the run's own for the caches libraries write unasked, removed at exit.

Importing torch (through transformers) makes torch's compiler cache folder
($TMPDIR/torchinductor_<user>) and matplotlib writes ~/.config/matplotlib and ~/.cache/matplotlib;
embedlens needs neither cache to outlive the run. A cache folder the user named (the variable set)
is left alone. SIGTERM unwinds the run as Ctrl-C does, so temporary folders (the --device-map
offload folder among them) are removed on the way out.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from types import FrameType

TERMINATED = 128 + signal.SIGTERM

_CACHES = {
    "TORCHINDUCTOR_CACHE_DIR": "torchinductor",  # torch._dynamo makes it when imported
    "TRITON_CACHE_DIR": "triton",
    "MPLCONFIGDIR": "matplotlib",  # matplotlib's config and font cache
}


def make_scratch() -> str | None:
    """Create the scratch folder, the run's temporary folder: the caches the user did not name
    and the run's own temporary files go in it."""
    unset = [name for name in _CACHES if not os.environ.get(name)]
    try:
        root = tempfile.mkdtemp(prefix="embedlens-")
    except OSError:
        return None  # no writable temporary folder: the libraries fall back as they would
    for name in unset:
        os.environ[name] = os.path.join(root, _CACHES[name])
    tempfile.tempdir = root  # the run's own temporary files (an offload folder) go in it too
    return root


def remove_scratch(root: str | None) -> None:
    """Remove the scratch folder and what the libraries put in it."""
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)
        if tempfile.tempdir == root:
            tempfile.tempdir = None


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the run at once
    raise SystemExit(TERMINATED)


def unwind_on_sigterm() -> None:
    """Let SIGTERM raise SystemExit, so `with` blocks and the scratch clean-up run."""
    try:
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread
        pass
