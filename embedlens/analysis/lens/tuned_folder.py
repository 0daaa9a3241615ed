"""A tuned lens's folder, read and matched to its model: what `tune` writes and `lens --tuned` reads.

`config.json` holds tuned-lens's keys (`base_model_name_or_path`, `d_model`, `num_hidden_layers`,
`bias`, `base_model_revision`, `unembed_hash`, `lens_type`), so tuned-lens reads it, and an
`embedlens` object with what refuses a lens for another model (the residual's width, the number
of blocks, a fingerprint of the decoder's weights, the vocabulary's fingerprint) and how the lens
was tuned. `params.safetensors` holds translator i as `{i}.weight` [d, d] and `{i}.bias` [d]:
tuned-lens's state-dict keys. A folder tuned-lens saved holds `params.pt` instead, a pickle: it
is read with `torch.load(weights_only=True)` only, which refuses a pickle that would run code.

Everything `open_folder` checks is read without torch (JSON and the safetensors header). The
checks that refuse a lens on another model: the residual's width and the number of blocks
(against the config, before the weights load), then fingerprints of the decoder's weights and of
the vocabulary (embedlens' lenses), or tuned-lens's hash of the head (tuned-lens's). `tune`
writes the folder (`analysis/tune/folder.py`); `decoders.Translators` are what it holds.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from embedlens.errors import CheckpointError, UnsupportedError, UsageError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from embedlens.analysis.lens.blocks import Blocks
    from embedlens.analysis.lens.jacobian import JacobianFile

CONFIG = "config.json"
PARAMS = "params.safetensors"
PICKLED = "params.pt"
LENS_TYPE = "linear_tuned_lens"


@dataclass(frozen=True)
class LensFolder:
    """A lens folder as its config describes it, checked without torch."""

    path: Path
    width: int
    """d_model: the residual stream's width."""
    num_layers: int
    """The translators (the model's blocks): layers 0..num_layers-1 have one."""
    bias: bool
    base_model: str
    params: Path
    """params.safetensors (embedlens, or tuned-lens saving safetensors) or params.pt."""
    unembed_hash: str | None
    """tuned-lens's hash of the head's weight (the corners of the matrix at one decimal)."""
    ours: dict[str, Any] | None
    """config.json's `embedlens` object (None in a lens tuned-lens saved)."""

    @property
    def made_by(self) -> str:
        """'embedlens', or 'tuned-lens' for a folder without embedlens' own keys."""
        return "embedlens" if self.ours is not None else "tuned-lens"


Learned: TypeAlias = "LensFolder | JacobianFile"
"""A learned lens: a tuned lens's folder or a Jacobian lens's artifact."""


def open_folder(path: str | os.PathLike[str]) -> LensFolder:
    """The lens folder at `path`, its config and translators' shapes checked (no torch)."""
    folder = Path(path)
    if not folder.is_dir():
        what = "does not exist" if not folder.exists() else "is not a folder"
        raise UsageError(
            f"--tuned '{folder}' {what}",
            hint="name a folder `embedlens tune` wrote (or one tuned-lens saved)",
        )
    config = _read_config(folder)
    width = _count(config, "d_model", folder)
    layers = _count(config, "num_hidden_layers", folder)
    bias = config.get("bias", True)
    lens_type = config.get("lens_type", LENS_TYPE)
    if lens_type != LENS_TYPE:
        raise UnsupportedError(
            f"'{folder / CONFIG}' describes a lens of type {lens_type!r}: embedlens reads "
            f"{LENS_TYPE!r} lenses (an affine translator per layer)"
        )
    if not isinstance(bias, bool):
        raise CheckpointError(f"'{folder / CONFIG}': bias must be true or false, not {bias!r}")
    ours = config.get("embedlens")
    if ours is not None and not isinstance(ours, dict):
        raise CheckpointError(f"'{folder / CONFIG}': 'embedlens' must be an object")
    params = _params_file(folder)
    if params.suffix == ".safetensors":
        _check_header(params, width, layers, bias)
    unembed = config.get("unembed_hash")
    return LensFolder(
        path=folder,
        width=width,
        num_layers=layers,
        bias=bias,
        base_model=str(config.get("base_model_name_or_path", "")),
        params=params,
        unembed_hash=unembed if isinstance(unembed, str) else None,
        ours=ours,
    )


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG
    if not path.is_file():
        raise UsageError(
            f"--tuned '{folder}' has no {CONFIG}: it is not a lens folder",
            hint="name a folder `embedlens tune` wrote (or one tuned-lens saved)",
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        reason = getattr(e, "strerror", None) or str(e)[:200]
        raise CheckpointError(f"cannot read '{path}': {reason}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"'{path}' is not a JSON object")
    return config


def _count(config: dict[str, Any], key: str, folder: Path) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(
            f"'{folder / CONFIG}': {key} must be a positive integer, not {value!r}"
        )
    return value


def _params_file(folder: Path) -> Path:
    for name in (PARAMS, PICKLED):
        if (folder / name).is_file():
            return folder / name
    raise UsageError(
        f"--tuned '{folder}' has neither {PARAMS} nor {PICKLED}: the translators are missing"
    )


def check_tensors(
    where: Path, found: dict[str, tuple[int, ...]], width: int, layers: int, bias: bool
) -> None:
    """The translators' names and shapes (tuned-lens's state-dict keys) are what config.json
    says; CheckpointError if not."""
    want: dict[str, tuple[int, ...]] = {}
    for i in range(layers):
        want[f"{i}.weight"] = (width, width)
        if bias:
            want[f"{i}.bias"] = (width,)
    missing = [k for k in want if k not in found]
    extra = [k for k in found if k not in want]
    if missing or extra:
        some = (missing or extra)[:3]
        what = "lacks" if missing else "has tensors config.json does not describe:"
        raise CheckpointError(
            f"'{where}' {what} {', '.join(some)}"
            + (f" and {len(missing or extra) - 3} more" if len(missing or extra) > 3 else "")
            + f" (config.json: {layers} translators of width {width}, bias {str(bias).lower()})"
        )
    for key, shape in want.items():
        if tuple(found[key]) != shape:
            raise CheckpointError(
                f"'{where}': {key} has shape {list(found[key])}, not {list(shape)} "
                f"(config.json: d_model {width})"
            )


def _check_header(path: Path, width: int, layers: int, bias: bool) -> None:
    from embedlens.io.checkpoint import read_safetensors_header

    header = read_safetensors_header(path)
    floats = {"F32", "F16", "BF16", "F64"}
    for entry in header.tensors.values():
        if entry.dtype not in floats:
            raise CheckpointError(f"'{path}': {entry.name} is {entry.dtype}, not a float type")
    check_tensors(path, {k: v.shape for k, v in header.tensors.items()}, width, layers, bias)


def read_translators(lens: LensFolder) -> tuple[torch.Tensor, torch.Tensor]:
    """The translators' weight [L, d, d] and bias [L, d] as float32 tensors (a missing bias is
    zero): `decoders.tuned_through` makes them `Translators`."""
    import torch

    state = _read_safetensors(lens) if lens.params.suffix == ".safetensors" else _unpickle(lens)
    weight = torch.stack([state[f"{i}.weight"].float() for i in range(lens.num_layers)])
    if lens.bias:
        bias = torch.stack([state[f"{i}.bias"].float() for i in range(lens.num_layers)])
    else:
        bias = torch.zeros(lens.num_layers, lens.width, dtype=torch.float32)
    if not bool(torch.isfinite(weight).all()) or not bool(torch.isfinite(bias).all()):
        raise CheckpointError(f"'{lens.params}' holds NaN or infinite values")
    return weight.contiguous(), bias.contiguous()


def _read_safetensors(lens: LensFolder) -> dict[str, Any]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return dict(load_file(str(lens.params)))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"cannot read '{lens.params}': {e}") from None


def _unpickle(lens: LensFolder) -> dict[str, Any]:
    """tuned-lens's params.pt, by torch's weights-only unpickler: only tensors and plain
    containers are built, and a pickle that would call anything else is refused unread."""
    import torch

    from embedlens.io.torchzip import weights_only

    state = weights_only(str(lens.params), "a lens folder holds tensors only")
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise CheckpointError(f"'{lens.params}' is not a state dict of tensors")
    found = {k: tuple(v.shape) for k, v in state.items()}
    check_tensors(lens.params, found, lens.width, lens.num_layers, lens.bias)
    return dict(state)


def head_weight(model: nn.Module) -> tuple[nn.Module | None, torch.Tensor | None]:
    """The model's head (`get_output_embeddings`) and its weight (None where there is none)."""
    import torch

    get_head: Any = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    weight = getattr(head, "weight", None)
    return head, weight if isinstance(weight, torch.Tensor) else None


def config_size(config: Any) -> tuple[int | None, int | None]:
    """(hidden size, number of blocks) as the model's config gives them (None when it does not)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    width = getattr(text, "hidden_size", None)
    layers = getattr(text, "num_hidden_layers", None)
    return (
        width if isinstance(width, int) else None,
        layers if isinstance(layers, int) else None,
    )


def open_learned(
    tuned: str | os.PathLike[str] | None, jacobian: str | os.PathLike[str] | None
) -> LensFolder | JacobianFile | None:
    """The learned lens asked for: a tuned lens's folder, a Jacobian lens's artifact, or none."""
    if tuned is not None and jacobian is not None:
        raise UsageError("--tuned and --jacobian do not combine: read through one learned lens")
    if jacobian is not None:
        from embedlens.analysis.lens.jacobian import open_jacobian

        return open_jacobian(jacobian)
    return None if tuned is None else open_folder(tuned)


def fits_tuned(lens: LensFolder | JacobianFile | None, config: Any) -> None:
    """Refuse, before the weights load, a lens whose width or layer count is not the model's
    config's (nothing without a lens)."""
    if lens is None:
        return
    width, layers = config_size(config)
    if not isinstance(lens, LensFolder):
        lens.fits(width, layers)
        return
    if (width is not None and width != lens.width) or (
        layers is not None and layers != lens.num_layers
    ):
        raise _other_model(
            lens,
            f"its translators are {lens.width} wide for {lens.num_layers} layers; this model's "
            f"residual stream is {width} wide with {layers} blocks",
        )


def check_model(
    lens: LensFolder, model: nn.Module, blocks: Blocks, tokenizer: Any, *, fingerprints: bool = True
) -> None:
    """Refuse, once the model is loaded, a lens tuned on another: its block count (`blocks`:
    the model's decoder blocks), then the fingerprints its config.json holds (the decoder's
    weights and the vocabulary for embedlens' lenses, the head's hash for tuned-lens's; not
    without `fingerprints`)."""
    count = len(blocks.modules)
    if count != lens.num_layers:
        raise _other_model(
            lens, f"it has translators for {lens.num_layers} layers; this model has {count} blocks"
        )
    if not fingerprints:
        return
    ours = lens.ours or {}
    checks: list[tuple[str, object, Callable[[], str | None]]] = [
        ("the decoder's weights have fingerprint", ours.get("decoder_fingerprint"),
         lambda: decoder_fingerprint(model, blocks)),
        ("the vocabulary has fingerprint", ours.get("vocab_fingerprint"),
         lambda: vocab_fingerprint(tokenizer, len(tokenizer))),
    ]  # fmt: skip
    if tokenizer is None:  # a caller's own model without its tokenizer: that check alone skipped
        checks = checks[:1]
    if lens.ours is None:
        checks = [("the head's unembed_hash is", lens.unembed_hash, lambda: unembed_hash(model))]
    for what, recorded, compute in checks:
        if not isinstance(recorded, str):
            continue
        mine = compute()
        if mine is not None and mine != recorded:
            raise _other_model(
                lens,
                f"{what} {recorded[:12]} in the lens and {mine[:12]} in this model",
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

    head = head_weight(model)[0]
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

    weight = head_weight(model)[1]
    if weight is None or weight.is_meta:
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
