"""The lens folder: what `tune` writes and `lens --tuned` reads.

`config.json` holds tuned-lens's keys (`base_model_name_or_path`, `d_model`, `num_hidden_layers`,
`bias`, `base_model_revision`, `unembed_hash`, `lens_type`), so tuned-lens reads it, and an
`embedlens` object with what refuses a lens for another model (the residual's width, the number
of blocks, a fingerprint of the decoder's weights, the vocabulary's fingerprint) and how the lens
was tuned. `params.safetensors` holds translator i as `{i}.weight` [d, d] and `{i}.bias` [d]:
tuned-lens's state-dict keys. A folder tuned-lens saved holds `params.pt` instead, a pickle: it
is read with `torch.load(weights_only=True)` only, which refuses a pickle that would run code.

Everything `open_folder` checks is read without torch (JSON and the safetensors header).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from embedlens.errors import CheckpointError, UnsupportedError, UsageError

if TYPE_CHECKING:
    from embedlens.analysis.lens.tuned import Translators

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


def expected_shapes(width: int, layers: int, bias: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor a lens of this size holds, tuned-lens's state-dict keys to shapes."""
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(layers):
        shapes[f"{i}.weight"] = (width, width)
        if bias:
            shapes[f"{i}.bias"] = (width,)
    return shapes


def check_tensors(
    where: Path, found: dict[str, tuple[int, ...]], width: int, layers: int, bias: bool
) -> None:
    """The translators' names and shapes are what config.json says; CheckpointError if not."""
    want = expected_shapes(width, layers, bias)
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


def load_translators(lens: LensFolder) -> Translators:
    """The translators as float32 tensors (a missing bias is zero)."""
    import torch

    from embedlens.analysis.lens.tuned import Translators

    state = _read_safetensors(lens) if lens.params.suffix == ".safetensors" else _unpickle(lens)
    weight = torch.stack([state[f"{i}.weight"].float() for i in range(lens.num_layers)])
    if lens.bias:
        bias = torch.stack([state[f"{i}.bias"].float() for i in range(lens.num_layers)])
    else:
        bias = torch.zeros(lens.num_layers, lens.width, dtype=torch.float32)
    if not bool(torch.isfinite(weight).all()) or not bool(torch.isfinite(bias).all()):
        raise CheckpointError(f"'{lens.params}' holds NaN or infinite values")
    return Translators(weight.contiguous(), bias.contiguous())


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
    import pickle

    import torch

    try:
        state = torch.load(str(lens.params), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"'{lens.params}' is not a plain file of tensors: its pickle asks for more than "
            f"tensors ({first[:160]}); refused, and nothing in it ran",
            hint="a lens folder holds tensors only; get the lens from a source you trust",
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        raise CheckpointError(f"cannot read '{lens.params}': {str(e)[:200]}") from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise CheckpointError(f"'{lens.params}' is not a state dict of tensors")
    found = {k: tuple(v.shape) for k, v in state.items()}
    check_tensors(lens.params, found, lens.width, lens.num_layers, lens.bias)
    return dict(state)


def lens_config(
    base_model: str,
    revision: str | None,
    unembed_hash: str | None,
    translators: Translators,
    ours: dict[str, Any],
) -> dict[str, Any]:
    """config.json: tuned-lens's `TunedLensConfig` keys, in its order, then embedlens' own."""
    return {
        "base_model_name_or_path": base_model,
        "d_model": translators.width,
        "num_hidden_layers": translators.num_layers,
        "bias": True,
        "base_model_revision": revision,
        "unembed_hash": unembed_hash,
        "lens_type": LENS_TYPE,
        "embedlens": ours,
    }


def write_folder(
    out: Path,
    translators: Translators,
    base_model: str,
    revision: str | None,
    unembed_hash: str | None,
    ours: dict[str, Any],
) -> None:
    """Write the lens to `out` whole or not at all (its config.json: `lens_config`): into a
    temporary folder beside it, renamed to `out` once complete (an interrupted run leaves
    nothing at `out`)."""
    from safetensors.torch import save_file

    config = lens_config(base_model, revision, unembed_hash, translators, ours)
    tensors = {}
    for i in range(translators.num_layers):
        tensors[f"{i}.weight"] = translators.weight[i].contiguous()
        tensors[f"{i}.bias"] = translators.bias[i].contiguous()
    with _beside(out) as tmp:
        save_file(tensors, str(tmp / PARAMS), metadata={"format": "pt"})
        text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        (tmp / CONFIG).write_text(text, encoding="utf-8")
        _usual_modes(tmp)
        os.rename(tmp, out)


def _usual_modes(folder: Path) -> None:
    """The modes a folder and files made by hand get (the umask's), not a temporary folder's
    private ones."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


@contextmanager
def _beside(out: Path) -> Iterator[Path]:
    """A temporary folder in `out`'s parent, removed unless it was renamed away."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def check_out(out: Path) -> None:
    """--out names a folder to create (or an empty one to fill) in a folder that can be
    written; checked before any work (UsageError if not)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "is a file" if not out.is_dir() else "already exists and is not empty"
        raise UsageError(
            f"--out '{out}' {what}", hint="name a new folder (the lens is written there whole)"
        )
    parent = out.parent
    if not parent.is_dir():
        raise UsageError(f"--out '{out}': its folder '{parent}' does not exist")
    try:
        with _beside(out):
            pass
    except OSError as e:
        raise UsageError(f"--out '{out}': cannot write in '{parent}': {e.strerror or e}") from None
