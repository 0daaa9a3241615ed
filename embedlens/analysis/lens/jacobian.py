"""The Jacobian lens's artifact: read, checked against the model, written.

The Jacobian lens (Gurnee et al., 2026) holds one d x d matrix per layer, the average effect of a
block's output on the last block's output (before the final norm); reading it is the model's own
tail on `J_l h`. Its artifact is the reference implementation's torch file, which TransformerLens
reads and writes too: `J` (artifact layer -> matrix, float16), `n_prompts`, `source_layers`,
`d_model`, and an optional `metadata` object. Artifact layer l is block l's output, embedlens'
layer l + 1; the last block's output has no matrix (its map is the identity), nor has the
embedding output (embedlens' layer 0), which the lens reads through the identity: the logit lens.

The file's pickle is read by an unpickler that builds tensors and plain containers alone (a
pickle that would run code is refused unread: `io.torchzip`), and each matrix is read when a row
of its layer is first decoded, so only the matrices of the layers decoded are read: from disk, or
on the hub by range where the hub cache does not hold the file. A legacy (pre-zip) file is read
by torch's weights-only unpickler. A fit checkpoint of the reference (`jacobian_sum`, `n_done`)
is read as its means, as TransformerLens reads it.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from embedlens.errors import CheckpointError, UsageError

if TYPE_CHECKING:
    import torch

_HUB = re.compile(r"^[\w.-]+/[\w.-]+(:.+)?$")
_HINT = "name a .pt file the Jacobian lens wrote (or a folder holding one, or HUB_ID:FILE)"


@dataclass(frozen=True)
class JacobianFile:
    """A Jacobian-lens artifact, its keys and matrices' shapes checked (the matrices not read)."""

    path: Path
    d_model: int
    n_prompts: int
    source_layers: tuple[int, ...]
    """The artifact's layers: block l's output (embedlens' layer l + 1)."""
    metadata: dict[str, Any]
    matrices: Mapping[int, Any]
    """Artifact layer -> [d, d]: a tensor, or where it lies in the file (`io.torchzip.LazyTensor`,
    read when asked for)."""
    scale: float = 1.0
    """What every matrix is multiplied by (a fit checkpoint's sums: 1 / n_done)."""

    @property
    def layers(self) -> tuple[int, ...]:
        """The embedlens layers with a matrix."""
        return tuple(layer + 1 for layer in self.source_layers)

    @property
    def made_by(self) -> str:
        """'embedlens', 'transformer-lens', or 'jacobian-lens' (the reference's artifact)."""
        if "embedlens" in self.metadata:
            return "embedlens"
        return "transformer-lens" if "transformer_lens_fit" in self.metadata else "jacobian-lens"

    def matrix(self, layer: int) -> torch.Tensor:
        """The matrix of embedlens layer `layer`, float32 (read from the file now)."""
        m = self.matrices[layer - 1]
        tensor: torch.Tensor = m.load() if hasattr(m, "load") else m
        return tensor.float() * self.scale

    def fits(self, width: int | None, blocks: int | None) -> None:
        """Refuse the lens for a model of another width or with fewer blocks than it has layers
        (a recorded target layer must be the model's last block)."""
        target = self.metadata.get("target_layer")
        why = None
        if width is not None and width != self.d_model:
            why = f"its matrices are {self.d_model} wide; this model's residual stream is {width}"
        elif blocks is not None and self.source_layers and max(self.source_layers) >= blocks - 1:
            why = (
                f"it has a matrix for block {max(self.source_layers)}'s output; this model has "
                f"{blocks} blocks, the last of which has none"
            )
        elif blocks is not None and isinstance(target, int) and target != blocks - 1:
            why = (
                f"it was fitted to block {target}'s output; this model's last block is {blocks - 1}"
            )
        if why is not None:
            raise UsageError(
                f"the Jacobian lens '{self.path}' was fitted on another model: {why}",
                hint="fit one on this model with `embedlens tune MODEL --jacobian`",
            )


class Transport:
    """A Jacobian lens as the decoders apply it: a row h read at layer l becomes J_l h (float32);
    a layer without a matrix is the identity. Each matrix is read from the file when a row of its
    layer is first decoded, so a run reads the matrices of the layers it decodes alone."""

    def __init__(self, lens: JacobianFile) -> None:
        self.lens = lens
        self.width = lens.d_model
        self._read: dict[int, torch.Tensor] = {}

    def apply(self, rows: torch.Tensor, layers: Sequence[int]) -> torch.Tensor:
        """Rows [n, d], row i moved by the matrix of layers[i], in float32."""
        import torch

        if rows.shape[-1] != self.width:
            raise UsageError(
                f"the Jacobian lens's matrices are {self.width} wide; this model's residual "
                f"stream is {rows.shape[-1]} wide: the lens was fitted on another model"
            )

        h = rows.float()
        out = h.clone()
        at = torch.tensor(list(layers), dtype=torch.long)
        for layer in sorted({int(x) for x in layers} & set(self.lens.layers)):
            if layer not in self._read:
                self._read[layer] = self.lens.matrix(layer)
            pick = (at == layer).nonzero().flatten().to(h.device)
            j = self._read[layer].to(h.device)
            out.index_copy_(0, pick, h.index_select(0, pick) @ j.T)
        return out


def _payload(spec: str | os.PathLike[str]) -> tuple[str, dict[str, Any]]:
    """The artifact `spec` names, and its payload (tensors lazy where its format allows): a file;
    a folder holding one .pt file; or HUB_ID:FILE, from the hub cache, else by range."""
    path = Path(spec)
    if path.is_dir():
        found = sorted(p for p in path.rglob("*.pt") if p.is_file())
        if len(found) != 1:
            what = "no .pt file" if not found else f"{len(found)} .pt files"
            raise UsageError(f"--jacobian '{path}' holds {what}", hint=_HINT)
        path = found[0]
    if path.is_file():
        return str(path), _load(path)
    text = str(spec)
    if _HUB.match(text) and ":" in text:
        repo, _, name = text.partition(":")
        return text, _hub_payload(repo, name)
    raise UsageError(f"--jacobian '{text}' does not exist", hint=_HINT)


def _hub_payload(repo: str, name: str) -> dict[str, Any]:
    """A hub artifact's payload: the hub cache's copy where it holds the whole file, else its
    directory and pickle by range now, each matrix by range when it is read."""
    from huggingface_hub import try_to_load_from_cache

    from embedlens.io import ranges
    from embedlens.io.torchzip import RangeFile, read_payload

    cached = try_to_load_from_cache(repo, name)
    if isinstance(cached, str):
        return _load(Path(cached))
    hub = ranges.describe(repo, name, None)
    file = RangeFile(hub.size, lambda start, stop: ranges.read_bytes(hub, start, stop))
    payload = read_payload(io.BufferedReader(file), f"{repo}:{name}")
    if not isinstance(payload, dict):
        raise CheckpointError(f"'{repo}:{name}' is not a Jacobian-lens artifact (not a dict)")
    return payload


def open_jacobian(spec: str | os.PathLike[str]) -> JacobianFile:
    """The artifact `spec` names, read by the weights-only unpickler, its keys checked."""
    where, payload = _payload(spec)
    path = Path(where)
    matrices: Any
    n_prompts: Any
    if "J" not in payload and "jacobian_sum" in payload:  # the reference's fit checkpoint
        done = payload.get("n_done")
        if not isinstance(done, int) or done < 1:
            raise CheckpointError(f"'{path}': a fit checkpoint's n_done must be a positive int")
        matrices, n_prompts, scale = payload["jacobian_sum"], done, 1.0 / done
    elif "J" in payload:
        matrices, n_prompts, scale = payload["J"], payload.get("n_prompts"), 1.0
    else:
        raise CheckpointError(f"'{path}' holds no 'J': it is not a Jacobian-lens artifact")
    metadata = payload.get("metadata") or {}
    if not isinstance(matrices, dict) or not matrices or not isinstance(metadata, dict):
        raise CheckpointError(f"'{path}': 'J' must map layers to matrices, 'metadata' an object")
    if not isinstance(n_prompts, int) or n_prompts < 0:
        raise CheckpointError(f"'{path}': n_prompts must be an int, not {n_prompts!r}")
    d_model = payload.get("d_model")
    shapes = {tuple(getattr(m, "shape", ())) for m in matrices.values()}
    if d_model is None and len(shapes) == 1:
        d_model = next(iter(shapes))[0] if next(iter(shapes)) else None
    if not isinstance(d_model, int) or shapes != {(d_model, d_model)}:
        raise CheckpointError(
            f"'{path}': every matrix must be d_model x d_model ({d_model!r}); found "
            + ", ".join(str(s) for s in sorted(shapes, key=str)[:3])
        )
    if not all(isinstance(k, int) and k >= 0 for k in matrices):
        raise CheckpointError(f"'{path}': the layers of 'J' must be ints from 0")
    listed = payload.get("source_layers")
    if listed is not None and sorted(listed) != sorted(matrices):
        raise CheckpointError(f"'{path}': source_layers {listed} are not the layers of 'J'")
    return JacobianFile(
        path, d_model, n_prompts, tuple(sorted(matrices)), metadata, matrices, scale
    )


def _load(path: Path) -> dict[str, Any]:
    """A local file's payload: a zip `torch.save` wrote read by `io.torchzip` (its tensors lazy,
    its pickle's globals refused but tensors and plain containers), a legacy file by torch's
    weights-only unpickler."""
    import zipfile

    from embedlens.io.torchzip import read_payload, weights_only

    if zipfile.is_zipfile(path):
        payload = read_payload(open(path, "rb"), str(path))  # noqa: SIM115 (read lazily, later)
    else:
        payload = weights_only(str(path), "a Jacobian-lens artifact holds tensors only")
    if not isinstance(payload, dict):
        raise CheckpointError(f"'{path}' is not a Jacobian-lens artifact (not a dict)")
    return payload


def write_artifact(
    path: str | os.PathLike[str],
    matrices: Mapping[int, torch.Tensor],
    *,
    n_prompts: int,
    metadata: Mapping[str, Any],
) -> Path:
    """Write matrices (artifact layer -> [d, d]) in the reference's format, float16, as
    TransformerLens's `JacobianLens.save` does; `metadata` is kept under 'metadata'. The file
    appears at `path` only once complete."""
    import torch

    out = Path(path)
    d_model = int(next(iter(matrices.values())).shape[0])
    payload = {
        "J": {int(k): m.detach().to(torch.float16).cpu() for k, m in sorted(matrices.items())},
        "n_prompts": int(n_prompts),
        "source_layers": sorted(int(k) for k in matrices),
        "d_model": d_model,
        "metadata": dict(metadata),
    }
    part = out.with_name(out.name + ".part")
    torch.save(payload, str(part))
    os.replace(part, out)
    return out
