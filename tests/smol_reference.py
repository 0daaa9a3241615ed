"""SmolLM2's embedding table as gguf's own reader loads it: the tests' independent reference.

gguf.GGUFReader takes seconds on this file (it decodes every token string), so it runs once per
test session.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class SmolTable:
    """token_embd.weight: raw quantised rows, dequantised rows, and where gguf says they are."""

    raw: np.ndarray
    """[V, row_bytes] uint8, a view of the file."""
    rows: np.ndarray
    """[V, d] float32, dequantised by gguf."""
    data_offset: int
    """Absolute offset of the tensor's first byte."""
    qtype: str
    tokens: list[str]
    control: list[int]
    """Ids of the control (special) tokens."""


@functools.cache
def smol_table(path: Path) -> SmolTable:
    """Read SmolLM2's embedding with gguf.GGUFReader and dequantise it with gguf."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == "token_embd.weight")
    field = reader.fields["tokenizer.ggml.token_type"]
    types = [int(field.parts[i][0]) for i in field.data]
    tokens_field = reader.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(tokens_field.parts[i]).decode("utf-8") for i in tokens_field.data]
    return SmolTable(
        raw=np.asarray(tensor.data),
        rows=dequantize(tensor.data, tensor.tensor_type),
        data_offset=int(tensor.data_offset),
        qtype=tensor.tensor_type.name,
        tokens=tokens,
        control=[i for i, t in enumerate(types) if t == 3],
    )


def plain_neighbors(table: np.ndarray, allowed: np.ndarray, query: np.ndarray, k: int) -> list[int]:
    """Normalise the rows, one product with the unit query, the k best allowed rows."""
    with np.errstate(invalid="ignore", divide="ignore"):  # zero rows give NaN, ranked last
        unit = table / np.linalg.norm(table, axis=1, keepdims=True)
        scores = unit @ (query / np.linalg.norm(query))
    scores[np.isnan(scores)] = -np.inf
    scores[~allowed] = -np.inf
    return [int(i) for i in np.argsort(-scores, kind="stable")[:k]]
