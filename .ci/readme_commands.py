"""Print one of README.md's two commands, as CI runs them: `setup` or `test`.

setup: the first ```bash block under the "Set-up" heading; test: the first ```bash block after it
that runs pytest.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def commands(text: str) -> dict[str, str]:
    """{'setup': ..., 'test': ...} from the README's text; ValueError when one is missing."""
    start = re.search(r"^## Set-up\b.*$", text, flags=re.M)
    if start is None:
        raise ValueError("README.md has no '## Set-up' section")
    blocks = [b.strip() for b in re.findall(r"```bash\n(.*?)```", text[start.end() :], flags=re.S)]
    if not blocks:
        raise ValueError("README.md's Set-up section has no ```bash block")
    test = next((b for b in blocks[1:] if "pytest" in b), None)
    if test is None:
        raise ValueError("README.md has no ```bash block running pytest after the set-up command")
    return {"setup": blocks[0], "test": test}


def main(argv: list[str]) -> int:
    """Print the command named by argv[1]."""
    if len(argv) != 2 or argv[1] not in ("setup", "test"):
        print("usage: readme_commands.py setup|test", file=sys.stderr)
        return 2
    try:
        print(commands(README.read_text(encoding="utf-8"))[argv[1]])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
