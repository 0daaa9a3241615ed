"""Where each parameter belongs: embedding, head, blocks (and their parts), norms, the rest.

One classifier serves header names (safetensors and GGUF) and module names alike, so `params`
gives the same answer with or without torch. Embedding and head are passed in by name: in module
mode they come from `get_input_embeddings()` / `get_output_embeddings()`, in header mode from
`find_tables` below.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

Role = Literal[
    "embedding", "lm_head", "position_embedding", "blocks", "final_norm", "towers", "other"
]
Part = Literal["attention", "mlp", "experts", "router", "norms", "other"]

_BLOCK = re.compile(r"(?:^|\.)(?:layers|h|blocks|block|layer|blk|decoder_layers)\.(\d+)\.(.+)$")
_EMBED_SUFFIXES = (
    "embed_tokens.weight", "wte.weight", "embed_in.weight", "word_embeddings.weight",
    "tok_embeddings.weight", "token_embd.weight", "embedding.weight", "wte.embedding.weight",
)  # fmt: skip
_HEAD_SUFFIXES = ("lm_head.weight", "embed_out.weight", "ff_out.weight", "output_layer.weight")
_GGUF_HEAD = "output.weight"
_POSITION = re.compile(r"(?:^|\.|_)(?:wpe|embed_positions|position_embeddings|position_embd)\.")
_BUFFER_SUFFIXES = (
    "inv_freq", "position_ids", "masked_bias", "cos_cached", "sin_cached", "_float_tensor",
)  # fmt: skip
_VISION = re.compile(
    r"(?:^|\.)(?:vision_tower|vision_model|visual|vision_encoder|vision_embed_tokens|image_newline"
    r"|multi_modal_projector|mm_projector|vision_projection)(?:\.|$)"
)
_AUDIO = re.compile(
    r"(?:^|\.)(?:audio_tower|audio_model|audio_encoder|audio_projection|audio_embed|"
    r"embed_audio|audio_projector)(?:\.|$)"
)
_EXPERTS = re.compile(r"(?:^|\.)experts\.|_exps\.|(?:^|\.)experts$")
_ROUTER = re.compile(r"(?:^|\.)(?:gate|router|ffn_gate_inp|switch)(?:\.|$)")
_NORM_SEGMENT = re.compile(r"norm|^ln_?\w*$|^ln\d*$")
_ATTN_SEGMENT = re.compile(r"attn|attention|^attn_")
_MLP_SEGMENT = re.compile(
    r"mlp|ffn|feed_forward|^fc\d?$|^fc_(?:in|out)$|shared_expert|dense_h_to_4h|dense_4h_to_h|^w[123]$"
)


@dataclass(frozen=True)
class Placement:
    """The role of one parameter, and for block parameters the layer and part."""

    role: Role
    layer: int | None = None
    part: Part | None = None


def is_buffer_name(name: str, shape: Sequence[int] = ()) -> bool:
    """Tensors some checkpoints store that are buffers, not parameters (rotary caches, masks)."""
    if name.endswith(_BUFFER_SUFFIXES):
        return True
    # Old GPT-2 checkpoints store the causal mask as `h.N.attn.bias` of shape [1, 1, n, n].
    return name.endswith("attn.bias") and len(shape) == 4


def place(name: str, *, embedding: Iterable[str], head: Iterable[str]) -> Placement:
    """Classify a parameter name given the names of the embedding and head weights."""
    if name in embedding:
        return Placement("embedding")
    if name in head or _is_head_bias(name, head):
        return Placement("lm_head")
    return _place_by_name(name)


@lru_cache(maxsize=1 << 18)
def _place_by_name(name: str) -> Placement:
    """The role of a tensor that is neither the embedding nor the head, from its name alone
    (kept: a 90,000-tensor checkpoint asks for each name three times)."""
    if tower(name) is not None:
        return Placement("towers")
    block = _BLOCK.search(name)
    if block is not None:
        return Placement("blocks", int(block.group(1)), block_part(block.group(2)))
    if _POSITION.search(name):
        return Placement("position_embedding")
    last = name.rsplit(".", 2)[-2] if "." in name else name
    if _NORM_SEGMENT.search(last) or last in {"ln_f", "norm_f"}:
        return Placement("final_norm")
    return Placement("other")


def tower(name: str) -> str | None:
    """'vision' or 'audio' for a tensor of a vision or audio tower (or its projector) stored
    beside the language model, else None."""
    if _VISION.search(name):
        return "vision"
    if _AUDIO.search(name):
        return "audio"
    return None


def _is_head_bias(name: str, head: Iterable[str]) -> bool:
    return name.endswith(".bias") and any(name[:-5] == h.removesuffix(".weight") for h in head)


def block_part(rest: str) -> Part:
    """The part of a block a parameter belongs to, from the name after the layer index."""
    if _EXPERTS.search(rest):
        return "experts"
    if _ROUTER.search(rest):
        return "router"
    segments = rest.split(".")[:-1] or rest.split(".")
    if any(_NORM_SEGMENT.search(s) for s in segments):
        return "norms"
    if any(_ATTN_SEGMENT.search(s) for s in segments):
        return "attention"
    if any(_MLP_SEGMENT.search(s) for s in segments):
        return "mlp"
    return "other"


def find_embedding(shapes: Mapping[str, Sequence[int]], vocab: int | None) -> str | None:
    """The input embedding's tensor name in a checkpoint, by name, then by shape."""
    candidates = [
        n
        for n in shapes
        if n.endswith(_EMBED_SUFFIXES) and not _BLOCK.search(n) and len(shapes[n]) == 2
    ]
    candidates.sort(key=lambda n: (not n.endswith(_EMBED_SUFFIXES[:6]), len(n)))
    if candidates:
        return candidates[0]
    if vocab:
        by_shape = [
            n for n, s in shapes.items() if len(s) == 2 and s[0] == vocab and not _BLOCK.search(n)
        ]
        heads = set(_head_candidates(shapes))
        by_shape = [n for n in by_shape if n not in heads]
        if len(by_shape) == 1:
            return by_shape[0]
    return None


def _head_candidates(shapes: Mapping[str, Sequence[int]]) -> list[str]:
    return [
        n
        for n in shapes
        if (n.endswith(_HEAD_SUFFIXES) or n == _GGUF_HEAD) and not _BLOCK.search(n)
    ]


def find_head(shapes: Mapping[str, Sequence[int]], embedding: str | None) -> str | None:
    """The output matrix's tensor name in a checkpoint, if it stores one."""
    for name in sorted(_head_candidates(shapes), key=len):
        if name != embedding and len(shapes[name]) == 2:
            return name
    return None


def find_tables(
    shapes: Mapping[str, Sequence[int]], vocab: int | None
) -> tuple[str | None, str | None]:
    """The input embedding's and the output matrix's tensor names in a checkpoint (None: not
    found; a tied head has none of its own, and without an embedding no head is looked for)."""
    embedding = find_embedding(shapes, vocab)
    return embedding, None if embedding is None else find_head(shapes, embedding)


def stored_layers(shapes: Mapping[str, Sequence[int]]) -> int:
    """How many blocks a checkpoint's tensors hold (buffers left out)."""
    layers = {
        place(n, embedding=(), head=()).layer for n, s in shapes.items() if not is_buffer_name(n, s)
    }
    layers.discard(None)
    return len(layers)
