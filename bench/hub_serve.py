"""Serve a model folder as hub repo `bench/<name>` on 127.0.0.1 with tests/hubserver.py, for
bench/run.py's hub rows: prints the endpoint's URL, then serves until stdin closes."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.hubserver import FakeHub


def main() -> None:
    folder = Path(sys.argv[1])
    with FakeHub(max_requests=1 << 30, lifetime_s=4 * 3600) as hub:
        hub.add(f"bench/{folder.name}", folder)
        print(hub.url, flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
