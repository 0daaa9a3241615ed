"""Is a lens for this model? What a lens folder records of the model it was tuned on, and the
checks that refuse it on another: the residual's width and the number of blocks (against the
config, before the weights load), then fingerprints of the decoder's weights and of the
vocabulary (embedlens' lenses), or tuned-lens's hash of the head (tuned-lens's).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from embedlens.analysis.tune.folder import LensFolder
from embedlens.errors import UsageError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from embedlens.analysis.lens.blocks import Blocks

SHOWN = 12
"""Hex digits of a fingerprint shown in messages."""


def config_size(config: Any) -> tuple[int | None, int | None]:
    """(hidden size, number of blocks) as the model's config gives them (None when it does not)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    width = getattr(text, "hidden_size", None)
    layers = getattr(text, "num_hidden_layers", None)
    return (
        width if isinstance(width, int) else None,
        layers if isinstance(layers, int) else None,
    )


def check_config(lens: LensFolder, config: Any) -> None:
    """Refuse, before the weights load, a lens whose width or layer count is not the model's."""
    width, layers = config_size(config)
    if (width is not None and width != lens.width) or (
        layers is not None and layers != lens.num_layers
    ):
        raise _other_model(
            lens,
            f"its translators are {lens.width} wide for {lens.num_layers} layers; this model's "
            f"residual stream is {width} wide with {layers} blocks",
        )


def check_model(lens: LensFolder, model: nn.Module, blocks: Blocks, tokenizer: Any) -> None:
    """Refuse, once the model is loaded, a lens tuned on another: its block count (`blocks`:
    the model's decoder blocks), then the fingerprints its config.json holds (the decoder's
    weights and the vocabulary for embedlens' lenses, the head's hash for tuned-lens's)."""
    count = len(blocks.modules)
    if count != lens.num_layers:
        raise _other_model(
            lens, f"it has translators for {lens.num_layers} layers; this model has {count} blocks"
        )
    ours = lens.ours or {}
    checks: list[tuple[str, object, Callable[[], str | None]]] = [
        ("the decoder's weights have fingerprint", ours.get("decoder_fingerprint"),
         lambda: decoder_fingerprint(model, blocks)),
        ("the vocabulary has fingerprint", ours.get("vocab_fingerprint"),
         lambda: vocab_fingerprint(tokenizer, len(tokenizer))),
    ]  # fmt: skip
    if lens.ours is None:
        checks = [("the head's unembed_hash is", lens.unembed_hash, lambda: unembed_hash(model))]
    for what, recorded, compute in checks:
        if not isinstance(recorded, str):
            continue
        mine = compute()
        if mine is not None and mine != recorded:
            raise _other_model(
                lens,
                f"{what} {recorded[:SHOWN]} in the lens and {mine[:SHOWN]} in this model",
            )


def _other_model(lens: LensFolder, why: str) -> UsageError:
    return UsageError(
        f"--tuned '{lens.path}' was tuned for another model ({lens.base_model or 'unnamed'}): "
        f"{why}",
        hint="tune a lens for this model with `embedlens tune MODEL --data FILE --out DIR`",
    )


@dataclass(frozen=True)
class Identity:
    """What a lens records of the model it was tuned on."""

    tokenizer_size: int
    decoder_fingerprint: str | None
    vocab_fingerprint: str | None
    unembed_hash: str | None
    """tuned-lens's hash of the head (config.json's own key)."""


def identify(model: nn.Module, blocks: Blocks, tokenizer: Any) -> Identity:
    """The model's (`blocks`: its decoder blocks) and its tokenizer's fingerprints, as a lens
    folder records them."""
    size = len(tokenizer)
    return Identity(
        tokenizer_size=size,
        decoder_fingerprint=decoder_fingerprint(model, blocks),
        vocab_fingerprint=vocab_fingerprint(tokenizer, size),
        unembed_hash=unembed_hash(model),
    )


def _weights(model: nn.Module, blocks: Blocks) -> list[torch.Tensor] | None:
    """The weights the decoder can read, in a fixed order: the head's, then every parameter
    outside the block list and the input embedding (final norms, projections); None when one
    is not in memory (offloaded)."""
    from torch import nn

    get_head: Any = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    get_input: Any = getattr(model, "get_input_embeddings", None)
    embedding = get_input() if callable(get_input) else None
    skip = {id(p) for p in blocks.modules.parameters()}
    if isinstance(embedding, nn.Module):
        skip |= {id(p) for p in embedding.parameters()}
    found: list[torch.Tensor] = list(head.parameters()) if isinstance(head, nn.Module) else []
    seen = {id(p) for p in found}
    for p in model.parameters():
        if id(p) not in skip and id(p) not in seen:
            found.append(p)
            seen.add(id(p))
    if any(p.is_meta for p in found):
        return None
    return found


def decoder_fingerprint(model: nn.Module, blocks: Blocks) -> str | None:
    """SHA-256 of the decoder's weights (those outside `blocks`) rounded to bfloat16 (the same
    for a float32 and a bfloat16 load of one checkpoint), shapes included; None when they are
    not in memory."""
    import torch

    weights = _weights(model, blocks)
    if weights is None:
        return None
    digest = hashlib.sha256(b"embedlens-decoder-v1\n")
    for p in weights:
        digest.update(repr(tuple(p.shape)).encode())
        rounded = p.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16)
        digest.update(rounded.numpy().tobytes())
    return digest.hexdigest()


def unembed_hash(model: nn.Module) -> str | None:
    """tuned-lens's `Unembed.unembedding_hash`: SHA-256 of numpy's printout of the head's
    weight at one decimal (its corners); None without a head in memory."""
    import numpy as np
    import torch

    get_head: Any = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.is_meta:
        return None
    array = weight.detach().to("cpu", torch.float32).numpy()
    return hashlib.sha256(str.encode(np.array_str(array, precision=1))).hexdigest()


def vocab_fingerprint(tokenizer: Any, size: int) -> str | None:
    """`embedlens vocab`'s fingerprint of the tokenizer's ids and bytes (`size`: its length;
    None for a tokenizer without a fast backend)."""
    from embedlens.analysis.vocab.fingerprint import fingerprint
    from embedlens.model.tokenizer import Vocab

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    vocab = Vocab(
        built=backend,
        size=size,
        special_ids=frozenset(int(i) for i in tokenizer.all_special_ids),
        unk_id=tokenizer.unk_token_id,
        origin="tokenizer",
    )
    return fingerprint(vocab)
