"""The newest releases CI tests, as a pip constraints file, and the check that a virtual
environment holds exactly them.

`python .ci/newest.py constraints FILE`: one `name==X` line for each release in NEWEST, each
checked to be admitted by pyproject.toml's bounds (a bound below the newest tested release fails
here, so pyproject's bounds are the tested ones).
`python .ci/newest.py check FILE`: each of FILE's packages is installed at that release.

NEWEST is the newest release of each that pip installs on the day it was last raised (`pip index
versions NAME`). torch: 2.15.0 is listed on the index, but the newest build this machine installs
is 2.14.1, a GPU build of 5 GB with its CUDA libraries, stored on disk (about 70 s to install
here, beside the benchmark); CI tests it.
"""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"

NEWEST = {
    "transformers": "5.25.0",
    "torch": "2.14.1",
    "huggingface_hub": "2.4.0",
    "tokenizers": "0.23.3",
    "gguf": "0.19.0",
    "accelerate": "1.16.0",
    "kernels": "0.19.1",  # what transformers 5.25 asks for
}


def _numbers(release: str) -> tuple[int, ...]:
    """'2.13.0+cpu' and '2.13' alike as (2, 13)."""
    parts = [int(p) for p in re.findall(r"\d+", release.split("+")[0])]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def refused_by_pyproject(text: str) -> list[str]:
    """Each NEWEST release that pyproject.toml's dependencies (in `text`) do not admit."""
    from packaging.requirements import Requirement

    wrong = []
    for line in tomllib.loads(text)["project"]["dependencies"]:
        requirement = Requirement(line)
        wanted = NEWEST.get(requirement.name.replace("-", "_"))
        if wanted is not None and not requirement.specifier.contains(wanted, prereleases=True):
            wrong.append(f"{requirement.name} {wanted} (pyproject.toml: {requirement.specifier})")
    return wrong


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("constraints", "check"):
        print("usage: newest.py constraints|check FILE", file=sys.stderr)
        return 2
    path = Path(argv[1])
    if argv[0] == "constraints":
        wrong = refused_by_pyproject(PYPROJECT.read_text(encoding="utf-8"))
        if wrong:
            print("error: pyproject.toml refuses the newest releases: " + "; ".join(wrong))
            return 1
        path.write_text("".join(f"{n}=={v}\n" for n, v in NEWEST.items()), encoding="utf-8")
        return 0
    wrong = []
    for name, wanted in NEWEST.items():
        have = metadata.version(name)
        if _numbers(have) != _numbers(wanted):
            wrong.append(f"{name} {have} (tested: {wanted})")
    if wrong:
        print("error: not the newest releases: " + "; ".join(wrong), file=sys.stderr)
        return 1
    print("newest releases installed: " + ", ".join(f"{n} {v}" for n, v in NEWEST.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
