"""Quantised checkpoints read from their headers: the logical parameters each packed tensor
holds, and the scales, zero points and indices beside them (bookkeeping, not parameters).

One reader per format lives in `formats.py` (FP8 with scales, MXFP4, NVFP4, compressed-tensors'
packed and integer layouts, GPTQ, AWQ, bitsandbytes, MLX); `config.py` reads what a
quantization_config says (bits, groups, what is left out); `pricing.py` prices a model built from
its config as its quantization_config would store it (`params --meta-only`). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from embedlens.io.checkpoint import Checkpoint, TensorEntry
from embedlens.model.quant.formats import FORMATS, Ctx, Found, index_bookkeeping, loose


@dataclass(frozen=True)
class Bookkeeping:
    """A stored tensor that is quantisation state, not a parameter."""

    name: str
    kind: str
    """'scales', 'zero points', 'indices', 'global scales', 'activation scales' or 'state'."""
    nbytes: int
    owner: str
    """The parameter it serves."""


@dataclass(frozen=True)
class Unpacked:
    """A checkpoint seen as its logical parameters."""

    checkpoint: Checkpoint
    """One entry per parameter: a quantised weight has its logical shape (its numel the values
    it holds) and the bytes of its stored values; other tensors as stored."""
    labels: dict[str, str] = field(default_factory=dict)
    """What each quantised parameter's stored values are ('int4 (pack-quantized) + bfloat16
    scales')."""
    bookkeeping: list[Bookkeeping] = field(default_factory=list)
    formats: tuple[str, ...] = ()
    """The formats found, in the order of FORMATS."""

    @property
    def quantised(self) -> bool:
        """Whether any tensor was read as a quantised weight."""
        return bool(self.labels)


def unpack(ckpt: Checkpoint, quant: Any) -> Unpacked:
    """The checkpoint's logical parameters: each format's reader takes the tensors it knows.

    quant: the config's quantization_config (MLX's `quantization`), None when absent.
    """
    if ckpt.format != "safetensors":
        return Unpacked(ckpt)
    tensors = dict(ckpt.tensors)
    config = quant if isinstance(quant, dict) else {}
    taken: set[str] = set()
    found: list[Found] = []
    formats: list[str] = []
    ctx = Ctx(tensors, config, taken, index_bookkeeping(tensors))
    for name, reader in FORMATS:
        got = reader(ctx)
        if got:
            formats.append(name)
            found.extend(got)
    if not found:
        return Unpacked(ckpt)
    labels: dict[str, str] = {}
    book: list[Bookkeeping] = []
    logical: dict[str, TensorEntry] = {}
    for f in found:
        first = f.values[0]
        nbytes = sum(v.nbytes for v in f.values)
        logical[f.name] = TensorEntry(
            f.name, first.dtype, f.shape, first.file, first.path, first.file_offset, nbytes,
            base=first.base,
        )  # fmt: skip
        labels[f.name] = f.label
        for t, kind in f.book:
            book.append(Bookkeeping(t.name, kind, t.nbytes, f.name))
    book.extend(Bookkeeping(t.name, kind, t.nbytes, t.name) for t, kind in loose(tensors, taken))
    out = {name: t for name, t in tensors.items() if name not in taken}
    out.update(logical)
    return Unpacked(
        replace(ckpt, tensors=out), labels, sorted(book, key=lambda b: b.name), tuple(formats)
    )


def kinds(book: list[Bookkeeping]) -> dict[str, tuple[int, int]]:
    """Bookkeeping by kind: (tensors, bytes), kinds in name order."""
    out: dict[str, tuple[int, int]] = {}
    for b in book:
        n, size = out.get(b.kind, (0, 0))
        out[b.kind] = (n + 1, size + b.nbytes)
    return dict(sorted(out.items()))
