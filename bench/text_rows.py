"""The bench rows of `lens --text` (imported by run.py): SmolLM2 on 16 windows of 512 against a
plain transformers script, --against against the single-model run, and the peak memory of a
text four times longer against a short one (the statistics are streamed: it must not grow)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def text_rows(row: Any, el: list[str], model: Path, other: Path, names: tuple[str, str],
              text: Path, quick: bool) -> list[Any]:  # fmt: skip
    """The rows (`row`: run.py's Row class)."""
    name, pair_name = names
    ctx = 64 if quick else 512
    long, short = 16 * ctx, 4 * ctx
    cmd = [*el, "lens", str(model), "--text", str(text), "--ctx", str(ctx), "--json"]
    plain = [sys.executable, str(HERE / "lens_text_plain.py"), str(model), str(text)]
    return [
        row(f"lens --text, 16 windows of {ctx} ({name})", [*cmd, "--max-tokens", str(long)],
            [*plain, str(long), str(ctx)], "plain transformers, output_hidden_states=True",
            budget=1.0),
        row(f"lens --text --against, 16 windows of {ctx} ({name} against {pair_name})",
            [*cmd, "--max-tokens", str(long), "--against", str(other)],
            [*cmd, "--max-tokens", str(long)], "lens --text alone", budget=2.2),
        row(f"lens --text peak memory, 16 windows against 4 ({name})",
            [*cmd, "--max-tokens", str(long)], [*cmd, "--max-tokens", str(short)],
            "the same on a text a quarter as long", mem_budget=1.1),
    ]  # fmt: skip
