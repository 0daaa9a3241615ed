"""The lens folder `tune` writes, whole or not at all (`analysis/lens/tuned_folder.py` reads it
and says what its config.json and params.safetensors hold)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from embedlens.analysis.lens.tuned_folder import CONFIG, LENS_TYPE, PARAMS
from embedlens.errors import UsageError

if TYPE_CHECKING:
    from embedlens.analysis.lens.decoders import Translators


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
