"""`--save-logits` / `--against-logits`: the output layer of a `lens --text` run, kept compactly.

A NumPy .npz file: per scored token, the top TOP_K token ids of the output and their
log-probabilities (over the whole softmax), the true next token's log-probability and the argmax;
with the run's token ids, window rule and vocabulary size, so that a later run on another model
(a quantisation of it) reads the same tokens and compares its output with this one. That is
O(tokens x k), not O(tokens x vocabulary) as llama.cpp's 16-bit --kl-divergence-base file.
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from embedlens.errors import UsageError

FORMAT = "embedlens-logits/1"
KEYS = ("ids", "logp", "target_logp", "top1")


@dataclass(frozen=True)
class LogitsFile:
    """A saved run's output: `meta` (model, ctx, stride, score, vocab, top_k, windows), the
    text's token ids, and per scored token the arrays of `KEYS`."""

    path: str
    meta: dict[str, Any]
    tokens: np.ndarray
    rows: dict[str, np.ndarray]
    starts: np.ndarray
    """Each window's first row in `rows`."""

    def window(self, index: int) -> dict[str, np.ndarray]:
        """The rows of window `index`."""
        a, b = int(self.starts[index]), int(self.starts[index + 1])
        return {k: v[a:b] for k, v in self.rows.items()}

    def check_run(self, tokens: list[int], ctx: int, stride: int, score: str, vocab: int) -> None:
        """Refuse a file made from another text, window rule or vocabulary."""
        m = self.meta
        mine = {"ctx": ctx, "stride": stride, "score": score, "vocab": vocab}
        for key, value in mine.items():
            if m.get(key) != value:
                raise UsageError(
                    f"--against-logits {self.path} was saved with {key} {m.get(key)}, this run "
                    f"has {value}",
                    hint="run with the options the file was saved with",
                )
        if len(self.tokens) != len(tokens) or not np.array_equal(self.tokens, tokens):
            raise UsageError(
                f"--against-logits {self.path} holds another text's tokens "
                f"({len(self.tokens):,} tokens; this run {len(tokens):,})",
                hint="give the same --text and --max-tokens, and models of the same tokenizer",
            )


def save(path: str | os.PathLike[str], meta: dict[str, Any], tokens: list[int],
         windows: list[dict[str, np.ndarray]]) -> None:  # fmt: skip
    """Write the file (windows in order)."""
    n = [len(w["top1"]) for w in windows]
    data = {k: np.concatenate([w[k] for w in windows]) for k in KEYS}
    head = {**meta, "format": FORMAT, "windows": n}
    text = np.frombuffer(json.dumps(head).encode(), dtype=np.uint8)
    with open(path, "wb") as f:
        arrays: dict[str, Any] = {"meta": text, "tokens": np.asarray(tokens, dtype=np.int32)}
        arrays.update(data)
        np.savez(f, **arrays)


def load(path: str | os.PathLike[str]) -> LogitsFile:
    """Read a file `save` wrote; anything else is refused with one line."""
    name = os.fspath(path)
    try:
        with np.load(name, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            if meta.get("format") != FORMAT:
                raise ValueError(meta.get("format"))
            tokens = z["tokens"]
            rows = {k: z[k] for k in KEYS}
    except FileNotFoundError:
        raise UsageError(f"--against-logits {name}: no such file") from None
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, UnicodeDecodeError) as e:
        raise UsageError(
            f"--against-logits {name} is not a logits file of lens --text --save-logits ({e})"
        ) from None
    starts = np.concatenate([[0], np.cumsum(meta["windows"])])
    return LogitsFile(name, meta, tokens, rows, starts)
