"""The `params` report: who owns the parameters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from embedlens.reports import Report

ParamsSource = Literal["header", "meta", "weights"]


@dataclass(frozen=True)
class ParamGroup:
    """A row of the share table."""

    name: str
    params: int
    fraction: float
    bytes: int | None
    """Bytes at the checkpoint's dtype (None when unknown)."""
    dtype: str | None = None
    """What its parameters are stored as ('bfloat16', 'int4 (pack-quantized) + bfloat16 group
    scales', several joined by ', '); None when unknown."""
    bits_per_param: float | None = None
    """bytes · 8 / params: the bits each parameter's stored value takes (bookkeeping apart)."""


@dataclass(frozen=True)
class BookkeepingRow:
    """Quantisation state of one kind: scales, zero points, indices, global or activation
    scales, packing state. Not parameters."""

    kind: str
    tensors: int
    bytes: int


@dataclass(frozen=True)
class PartRow:
    """A part of the checkpoint the config's layer count and width leave out or hide: MTP
    layers, vision or audio towers, routed and shared experts."""

    name: str
    params: int
    bytes: int | None


@dataclass(frozen=True)
class BlockRow:
    """One decoder block's parameters by part."""

    layer: int
    params: int
    attention: int
    mlp: int
    experts: int
    router: int
    norms: int
    other: int


@dataclass(frozen=True)
class MoEInfo:
    """Mixture-of-experts figures: what a token actually uses."""

    num_experts: int
    experts_per_token: int
    expert_params: int
    """Parameters of all routed experts, all layers."""
    active_params: int
    """Parameters used per token: everything but the routed experts a token skips."""
    active_fraction: float


@dataclass(frozen=True)
class ParamsReport(Report):
    """Parameter shares of a model, tied matrices counted once."""

    command: ClassVar[str] = "params"
    model: str
    source: ParamsSource
    total: int
    embedding: int
    lm_head: int
    tied: bool
    embedding_fraction: float
    embedding_lm_head_fraction: float
    vocab_size: int
    hidden_size: int
    num_layers: int
    dtype: str | None
    total_bytes: int | None
    head_flops_per_token: int
    """2·V·d: operations of the LM head (or of a one-hot lookup) for one position."""
    forward_flops_per_token: int
    """About 2 operations per weight a token passes through (the blocks, the head; the embedding
    is a gather), attention over the context left out."""
    head_flops_fraction: float
    """The head's share of forward_flops_per_token."""
    groups: list[ParamGroup]
    block_parts: list[ParamGroup]
    """The decoder blocks split by part (attention, mlp, experts, router, norms, other)."""
    moe: MoEInfo | None = None
    blocks: list[BlockRow] = field(default_factory=list)
    """Per-block rows, filled when asked for (--per-block)."""
    skipped: list[str] = field(default_factory=list)
    """Stored tensors that are buffers, not parameters (e.g. rotary caches), left out."""
    notes: list[str] = field(default_factory=list)
    quantised: bool = False
    """Some parameters are stored quantised (packed, or with scales)."""
    bookkeeping: list[BookkeepingRow] = field(default_factory=list)
    """Quantisation state stored beside the parameters, by kind (not counted in `total`)."""
    bookkeeping_bytes: int | None = 0
    """Bytes of all bookkeeping (None when unknown)."""
    stored_bytes: int | None = None
    """total_bytes + bookkeeping_bytes: what the weights take as stored."""
    parts: list[PartRow] = field(default_factory=list)
    """MTP layers, vision and audio towers, routed and shared experts, where present."""
    stated_total: int | None = None
    """The parameter count the checkpoint's metadata states (`total_parameters`), if any."""
