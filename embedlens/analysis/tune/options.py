"""What `tune` is asked for, checked before any model file is read: the data and held-out files,
the output folder, the token counts, the refinement's steps and learning rate."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embedlens.errors import UsageError

METHODS = ("kl", "affine")
"""kl: least squares, then the KL refinement (tuned-lens's objective); affine: least squares."""
TOKENS = 40_000
EVAL_TOKENS = 2_048
REFINE_TOKENS = 2_048
ROWS_PER_STEP = 128
"""The refinement's default steps: its tokens / ROWS_PER_STEP."""
LR = 0.3
"""The refinement's default learning rate (tuned-lens's lr scale; its default, 1.0, is for
hundreds of steps of 2^18 tokens from the identity: from the least-squares start, with 128 rows a
step, it overshoots the last layers, which start close to their best. On SmolLM2, 2,048 tokens in
16 steps: mean held-out KL over layers 1.693 nats after least squares, 1.509 refined at 1.0 and
1.502 at 0.3, where every layer but the last improved)."""


@dataclass(frozen=True)
class TuneAsk:
    """What tune is asked for, checked."""

    data: Path
    out: Path
    eval_file: Path | None
    seq_len: int | None
    """None: `data.SEQ_LEN`, or the model's context when shorter."""
    tokens: int
    eval_tokens: int
    refine_tokens: int
    steps: int
    lr: float
    method: str
    seed: int


def ask(
    data: str | os.PathLike[str],
    out: str | os.PathLike[str],
    eval_file: str | os.PathLike[str] | None,
    seq_len: int | None,
    tokens: int,
    eval_tokens: int,
    refine: tuple[int | None, int | None, float | None],
    method: str,
    seed: int,
) -> TuneAsk:
    """Check everything that needs no model: counts, the method, the files, --out."""
    from embedlens.analysis.tune import data as data_file
    from embedlens.analysis.tune.folder import check_out

    if method not in METHODS:
        raise UsageError(f"unknown --method {method!r}", hint="use one of: " + ", ".join(METHODS))
    for name, value in (("--tokens", tokens), ("--eval-tokens", eval_tokens)):
        _positive(name, value)
    if seq_len is not None and (_integer(seq_len) is None or seq_len < 2):
        raise UsageError(f"--seq-len must be at least 2, not {seq_len!r}")
    for name, value in (("--tokens", tokens), ("--eval-tokens", eval_tokens)):
        if seq_len is not None and seq_len > value:
            raise UsageError(
                f"--seq-len {seq_len:,} is more than {name} ({value:,}): sequences are whole",
                hint=f"give a --seq-len of at most {value:,}, or more {name}",
            )
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise UsageError(f"--seed must be a non-negative integer, not {seed!r}")
    refine_tokens, steps, lr = _refinement(method, *refine, tokens)
    data_path = Path(data)
    eval_path = None if eval_file is None else Path(eval_file)
    data_file.check_file(data_path, tokens + (eval_tokens if eval_path is None else 0))
    if eval_path is not None:
        data_file.check_file(eval_path, eval_tokens, "--eval")
    out_path = Path(out)
    check_out(out_path)
    return TuneAsk(data_path, out_path, eval_path, seq_len, tokens, eval_tokens, refine_tokens,
                   steps, lr, method, seed)  # fmt: skip


def _refinement(
    method: str, tokens: int | None, steps: int | None, lr: float | None, fit: int
) -> tuple[int, int, float]:
    """(tokens, steps, lr) of the refinement: none with --method affine, which refuses them."""
    if method == "affine":
        given = [n for n, v in (("--refine-tokens", tokens), ("--steps", steps), ("--lr", lr))
                 if v is not None]  # fmt: skip
        if given:
            raise UsageError(
                f"{', '.join(given)} apply to the refinement: --method affine has none",
                hint="leave them out, or use --method kl",
            )
        return 0, 0, 0.0
    refine = REFINE_TOKENS if tokens is None else _positive("--refine-tokens", tokens)
    refine = min(refine, fit) if tokens is None else refine
    if refine > fit:
        raise UsageError(
            f"--refine-tokens {refine:,} is more than the tokens fitted (--tokens {fit:,}): the "
            "refinement reads a share of them"
        )
    n_steps = max(1, refine // ROWS_PER_STEP) if steps is None else _positive("--steps", steps)
    rate = LR if lr is None else lr
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < math.inf:
        raise UsageError(f"--lr must be a positive number, not {lr!r}")
    return refine, n_steps, float(rate)


def _integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _positive(name: str, value: Any) -> int:
    if _integer(value) is None or value < 1:
        raise UsageError(f"{name} must be a positive integer, not {value!r}")
    return int(value)
