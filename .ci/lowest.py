"""The lowest releases pyproject.toml admits, as a pip constraints file, and the check that a
virtual environment holds exactly them.

`python .ci/lowest.py constraints FILE`: one `name==X` line for each runtime dependency's lower
bound `name>=X` (a dependency without one is refused: every bound is one CI proves).
`python .ci/lowest.py check FILE`: each of FILE's packages is installed at that release.
"""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def lower_bounds(text: str) -> dict[str, str]:
    """{name: lowest release} of the runtime dependencies in pyproject.toml's text."""
    found: dict[str, str] = {}
    for requirement in tomllib.loads(text)["project"]["dependencies"]:
        match = re.match(r"^\s*([A-Za-z0-9_.-]+)\s*(.*)$", requirement)
        assert match is not None, requirement
        name, spec = match.groups()
        low = re.search(r">=\s*([0-9][0-9.]*)", spec)
        if low is None:
            raise SystemExit(f"error: {requirement!r} in pyproject.toml has no lower bound")
        found[name] = low.group(1)
    return found


def _numbers(release: str) -> tuple[int, ...]:
    """'2.13.0+cpu' and '2.13' alike as (2, 13)."""
    parts = [int(p) for p in re.findall(r"\d+", release.split("+")[0])]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("constraints", "check"):
        print("usage: lowest.py constraints|check FILE", file=sys.stderr)
        return 2
    bounds = lower_bounds(PYPROJECT.read_text(encoding="utf-8"))
    path = Path(argv[1])
    if argv[0] == "constraints":
        path.write_text("".join(f"{n}=={v}\n" for n, v in bounds.items()), encoding="utf-8")
        return 0
    wrong = []
    for name, wanted in bounds.items():
        have = metadata.version(name)
        if _numbers(have) != _numbers(wanted):
            wrong.append(f"{name} {have} (pyproject's lower bound: {wanted})")
    if wrong:
        print("error: not the lowest releases: " + "; ".join(wrong), file=sys.stderr)
        return 1
    print("lowest releases installed: " + ", ".join(f"{n} {v}" for n, v in bounds.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
