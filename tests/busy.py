"""Other work on the machine, made by the tests: processes that keep a core busy each.

`python -m tests.busy N COMMAND...` runs COMMAND with N such processes beside it (CI runs the
quick suite so) and exits with COMMAND's status.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

_SPIN = "while True:\n    pass\n"


@contextmanager
def busy_processes(n: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`n` processes spinning a core each for as long as the block runs."""
    spinning = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(n)]
    try:
        yield spinning
    finally:
        for process in spinning:
            process.kill()
        for process in spinning:
            process.wait()


def main(argv: list[str]) -> int:
    """Run argv[1:] with int(argv[0]) busy processes beside it; its exit status."""
    if len(argv) < 2 or not argv[0].isdigit():
        print("usage: python -m tests.busy N COMMAND...", file=sys.stderr)
        return 2
    with busy_processes(int(argv[0])) as spinning:
        print(f"+ {len(spinning)} busy processes beside: {' '.join(argv[1:])}", file=sys.stderr)
        return subprocess.run(argv[1:]).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
