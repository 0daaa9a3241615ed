"""Write a text to run `embedlens lens MODEL --text` on, from what Python ships.

    python bench/text_file.py pydoc pydoc.txt

'pydoc': Python's help topics (`pydoc_data.topics`, English prose and code, about 105,000
SmolLM2 tokens), sorted by topic: the same text on every machine with the same Python.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] != "pydoc":
        raise SystemExit("usage: python bench/text_file.py pydoc OUT")
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k].strip() for k in sorted(topics)) + "\n"
    Path(sys.argv[2]).write_text(text, encoding="utf-8")
    print(f"wrote {sys.argv[2]}: {len(text):,} characters of Python's help topics")


if __name__ == "__main__":
    main()
