"""Files of hidden states (docs/states.md): vLLM's, and embedlens' own, read lazily by layer
and position.

Both are safetensors files holding `token_ids` [T] and `hidden_states` [T, N, H]: the residual
stream at N layers for each of the T tokens (vLLM's layers given by `--state-layers`, embedlens'
stated in its metadata, with its model's own logits at the last position for the self-check).
The file is memory-mapped: only the rows read are copied, so a file larger than memory works.

Written by `lens --save-states`: one prompt's to the file named (`save_run`), many prompts' or
windows' to a folder, a file each (`ManySaver`), rank 0 alone writing under torchrun.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from embedlens.errors import CheckpointError, EmbedlensError, NumericError, UsageError

if TYPE_CHECKING:
    import torch

    from embedlens.analysis.dist import Session
    from embedlens.analysis.lens.opening import Opened, Prompt
    from embedlens.analysis.lens.options import Ask
    from embedlens.analysis.lens.sites import Pieces
    from embedlens.model.prompts import PromptLine

FORMAT = "embedlens-states"
FORMAT_VERSION = "1"
LAYER_0 = "the embedding output (the first block's input); layer i is block i's output"
_FLOATS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
_INTS = {"I64", "I32", "I16", "U32", "U16", "I8", "U8", "U64"}


@dataclass(frozen=True)
class StatesFile:
    """A states file, its header checked: what it holds and where, nothing read yet."""

    path: Path
    layout: str
    """'embedlens' (its metadata states the layers) or 'vllm' (layers from --state-layers)."""
    n_tokens: int
    layers: list[int]
    """The layer of each index along the file's second axis (0 = the embedding output)."""
    hidden_size: int
    dtype: str
    """The states' dtype as stored ('bfloat16')."""
    metadata: dict[str, str]
    has_logits: bool
    sites: tuple[str, ...] = ("resid",)
    """The sites it holds: resid (`hidden_states`), and those inside the blocks an embedlens
    file saved with `--site` holds, each a tensor of its name [T, L, H] (block i at index i-1)."""
    splits: tuple[tuple[bool, str, str, float, float], ...] = ()
    """With sites inside the blocks: how each block's output split (`sites.Split`'s fields)."""

    def token_ids(self) -> list[int]:
        """The ids the states were computed on."""
        return [int(i) for i in self._tensor("token_ids").tolist()]

    def rows(self, layer: int, positions: list[int], site: str = "resid") -> torch.Tensor:
        """The states of one layer (at one site) at `positions`: [P, H], as stored (only these
        rows read)."""
        import torch

        own = site == "resid"
        index = self.layers.index(layer) if own else layer - 1
        with _opened(self.path) as handle:
            part = handle.get_slice("hidden_states" if own else site)
            if positions == list(range(self.n_tokens)):
                return part[:, index]  # type: ignore[no-any-return]
            return torch.stack([part[p, index] for p in positions])

    def finite_rows(self, layer: int, positions: list[int], site: str = "resid") -> torch.Tensor:
        """`rows`, refused when one is not finite (NaN: not decodable)."""
        import torch

        rows = self.rows(layer, positions, site)
        bad = ~torch.isfinite(rows.float()).all(-1)
        if bool(bad.any()):
            p = positions[int(bad.nonzero()[0, 0])]
            what = "NaN" if bool(torch.isnan(rows[bad]).any()) else "infinite"
            raise NumericError(
                f"'{self.path.name}' holds a {what} state at layer {layer}, position {p}: it "
                "cannot be decoded"
            )
        return rows

    def check_sites(self, sites: Sequence[str]) -> None:
        """Refuse a site the file does not hold, naming those it holds."""
        lacking = [s for s in sites if s not in self.sites]
        if lacking:
            raise UsageError(
                f"'{self.path.name}' does not hold --site {lacking[0]}: it holds "
                f"{', '.join(self.sites)}",
                hint="save the sites with `lens MODEL PROMPT --site SITES --save-states FILE`",
            )

    def pieces(self, layers: list[int], positions: list[int]) -> Pieces:
        """The blocks taken apart as the file holds them, at `layers` (>= 1) and `positions`,
        float32: each block's input and output from the residual stream, its sites inside."""
        from embedlens.analysis.lens.sites import PIECE, Pieces, Split

        pieces = Pieces(splits={i + 1: Split(*s) for i, s in enumerate(self.splits)})
        for layer in layers:
            pieces.pre[layer] = self.finite_rows(layer - 1, positions).float()
            pieces.post[layer] = self.finite_rows(layer, positions).float()
            for site in self.sites[1:]:
                piece = getattr(pieces, PIECE[site])
                piece[layer] = self.finite_rows(layer, positions, site).float()
        return pieces

    def why_not_checked(self, n_layers: int) -> str | None:
        """Why the self-check could not be made (None when it was)."""
        if not self.has_logits:
            return (
                "not made: the file holds no logits of the model to compare with (vLLM's hidden "
                "states carry none), so nothing here shows that the decoding reproduces the model"
            )
        if n_layers not in self.layers:
            return f"not made: the file lacks the last layer ({n_layers}) to decode"
        return None

    def logits(self) -> torch.Tensor | None:
        """The model's own logits at the last position (embedlens' file), float32 [V]."""
        return self._tensor("logits").float() if self.has_logits else None

    def _tensor(self, name: str) -> torch.Tensor:
        with _opened(self.path) as handle:
            value: torch.Tensor = handle.get_slice(name)[...]
        return value


def open_states(path: str | os.PathLike[str], state_layers: str | None) -> StatesFile:
    """The file's header read and checked (CheckpointError: truncated, corrupt, not a states
    file); its layers from its metadata or `state_layers` ('1,2,3,4' or '1:5')."""
    from embedlens.io.checkpoint import read_safetensors_header

    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--states '{file}' is not a file")
    header = read_safetensors_header(file)
    tensors = header.tensors
    name = file.name
    hidden = tensors.get("hidden_states")
    ids = tensors.get("token_ids")
    if hidden is None or ids is None:
        raise CheckpointError(
            f"'{name}' is no file of hidden states: it lacks "
            + " and ".join(n for n in ("token_ids", "hidden_states") if n not in tensors),
            hint="give a file vLLM's hidden-states connector or `lens --save-states` wrote",
        )
    if len(hidden.shape) != 3 or hidden.dtype not in _FLOATS:
        raise CheckpointError(
            f"'{name}': hidden_states is {hidden.dtype} {list(hidden.shape)}; a states file holds "
            "floats [tokens, layers, hidden size]"
        )
    n_tokens, n_layers, size = hidden.shape
    if len(ids.shape) != 1 or ids.dtype not in _INTS or ids.shape[0] != n_tokens or not n_tokens:
        raise CheckpointError(
            f"'{name}': token_ids is {ids.dtype} {list(ids.shape)}, which does not match "
            f"hidden_states' {n_tokens} tokens"
        )
    if state_layers is None and "layers" in tensors and header.metadata.get("format") != FORMAT:
        state_layers = _stated_layers(file, tensors["layers"], n_layers)
    layers, layout = _layers(name, header.metadata, state_layers, n_layers)
    sites, splits = _sites(name, header.metadata, tensors, [n_tokens, n_layers - 1, size])
    logits = tensors.get("logits")
    has_logits = logits is not None and len(logits.shape) == 1 and logits.dtype in _FLOATS
    return StatesFile(
        path=file,
        layout=layout,
        n_tokens=n_tokens,
        layers=layers,
        hidden_size=size,
        dtype=_FLOATS[hidden.dtype],
        metadata=header.metadata,
        has_logits=has_logits,
        sites=sites,
        splits=splits,
    )


def _sites(
    name: str, metadata: dict[str, str], tensors: dict[str, Any], shape: list[int]
) -> tuple[tuple[str, ...], tuple[tuple[bool, str, str, float, float], ...]]:
    """The sites an embedlens file holds (resid alone unless its metadata names others), each
    checked: a float tensor [T, L, H] beside hidden_states' [T, L+1, H]; and the blocks' splits."""
    import json

    held = [s for s in metadata.get("sites", "").split(",") if s]
    for site in held:
        t = tensors.get(site)
        if site == "resid" or t is None or list(t.shape) != shape or t.dtype not in _FLOATS:
            what = "lacks it" if t is None else f"holds {t.dtype} {list(t.shape)}"
            raise CheckpointError(
                f"'{name}': its metadata names the site {site}, but the file {what} (a site "
                f"inside the blocks is floats {shape})"
            )
    try:
        splits = tuple(tuple(s) for s in json.loads(metadata["block_splits"])) if held else ()
    except (KeyError, ValueError, TypeError):
        raise CheckpointError(f"'{name}': its metadata names sites, but no block_splits") from None
    return ("resid", *held), splits


def _stated_layers(file: Path, info: Any, n_layers: int) -> str:
    """A plain file's own `layers` tensor (integers [N]) as --state-layers would give them."""
    if info.dtype not in _INTS or list(info.shape) != [n_layers]:
        raise CheckpointError(
            f"'{file.name}': layers is {info.dtype} {list(info.shape)}; a plain states file's "
            f"layers are integers, one per state ({n_layers})"
        )
    with _opened(file) as handle:
        return ",".join(str(int(x)) for x in handle.get_tensor("layers").tolist())


def _layers(
    name: str, metadata: dict[str, str], state_layers: str | None, n_layers: int
) -> tuple[list[int], str]:
    """The layer of each index along the second axis, and the file's layout."""
    own = metadata.get("format") == FORMAT
    if own and state_layers is not None:
        raise UsageError(
            f"'{name}' states its layers ({metadata.get('layers')}): --state-layers applies to "
            "files that do not (vLLM's)"
        )
    if not own and state_layers is None:
        raise UsageError(
            f"'{name}' does not say which layers its {n_layers} states are",
            hint="give them with --state-layers, e.g. the eagle_aux_hidden_state_layer_ids "
            "vLLM was given (layer i: the input of block i; 0 the embedding output)",
        )
    spec = metadata.get("layers", "") if own else str(state_layers)
    layers = parse_layers(spec, name if own else "--state-layers")
    if len(layers) != n_layers:
        raise UsageError(
            f"{'the metadata of ' + repr(name) if own else '--state-layers'} names "
            f"{len(layers)} layers, but its hidden_states hold {n_layers}"
        )
    return layers, "embedlens" if own else "vllm"


def parse_layers(spec: str, what: str) -> list[int]:
    """'1,2,3' or '0:31' (stop exclusive) -> layer numbers, each once, none negative."""
    out: list[int] = []
    try:
        for part in spec.split(","):
            if ":" in part:
                start, _, stop = part.partition(":")
                out.extend(range(int(start), int(stop)))
            else:
                out.append(int(part))
    except ValueError:
        raise UsageError(
            f"{what}: '{spec}' is not a list of layers such as 1,2,3,4 or 0:31"
        ) from None
    if not out or len(set(out)) != len(out) or min(out) < 0:
        raise UsageError(f"{what}: '{spec}' must name each layer once, none negative")
    return out


@contextmanager
def _opened(path: Path) -> Iterator[Any]:
    """safe_open, its failure (a file changed since its header was read) one CheckpointError."""
    from safetensors import safe_open

    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:
        raise CheckpointError(f"cannot read '{path.name}': {e}") from e
    with handle as opened:
        yield opened


def save_states(
    path: str | os.PathLike[str],
    residual: torch.Tensor,
    ids: list[int],
    logits: torch.Tensor | None,
    about: dict[str, str],
    sites: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write embedlens' states file: `residual` [T, L+1, H] (layer 0 the embedding output),
    the ids, the model's logits at the last position, `about` (model, revision, dtype,
    prompt, and the sites' metadata) with the layers in the metadata, and `sites` inside the
    blocks [T, L, H] by name."""
    import torch

    n_layers = int(residual.shape[1])
    tensors = {
        "token_ids": torch.tensor(ids, dtype=torch.int64),
        "hidden_states": residual.contiguous(),
        **{name: t.contiguous() for name, t in (sites or {}).items()},
    }
    if logits is not None:
        tensors["logits"] = logits.detach().float().cpu().contiguous()
    metadata = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "layers": f"0:{n_layers}",
        "layer_0": LAYER_0,
        "dtype": str(residual.dtype).removeprefix("torch."),
        **about,
    }
    if logits is not None:
        metadata["logits"] = "the model's own logits at the last position, float32"
    from embedlens.io.tensor_bytes import write_safetensors

    try:
        write_safetensors(path, tensors, metadata)
    except OSError as e:
        raise EmbedlensError(f"cannot write the states to '{path}': {e.strerror or e}") from e


States = tuple["torch.Tensor", "torch.Tensor | None", dict[str, str], dict[str, "torch.Tensor"]]
"""A prompt's residual [T, L+1, H], the model's logits at its last position, the metadata, the
sites inside the blocks [T, L, H] by name."""


def save_run(
    path: str | os.PathLike[str],
    opened: Opened,
    run: Prompt,
    ask: Ask,
    revision: str | None,
) -> None:
    """Run the prompt once more, keeping every layer at every position (and every site asked
    for) and the model's own logits at the last position, and write them to `path`."""
    about = prompt_about(run, ask)
    residual, logits, about, inner = states_of(opened, run.ids, revision, about, ask.sites)
    save_states(path, residual, run.ids, logits, about, inner)


def prompt_about(run: Prompt, ask: Ask) -> dict[str, str]:
    """What a prompt's states file says of it: its text (and its chat message)."""
    return {"prompt": run.text} | ({} if ask.chat is None else {"chat": ask.chat})


def states_of(
    opened: Opened,
    ids: list[int],
    revision: str | None,
    about: dict[str, str],
    sites: Sequence[str] = ("resid",),
) -> States:
    """`ids` run alone (as `lens` runs a prompt, on the model's devices): every layer at every
    position, on the CPU, the model's own logits at the last position, the metadata (the
    model's and `about`), and the `sites` inside the blocks (`site_tensors`)."""
    import torch

    from embedlens.analysis.lens.blocks import capture, find_blocks, hooked, threads_for

    model = opened.model
    blocks = find_blocks(model)
    n_layers = len(blocks.modules)
    every = list(range(len(ids)))
    kept: list[torch.Tensor] = []

    def own_logits(_m: Any, _args: Any, out: Any) -> None:
        logits = out.logits if hasattr(out, "logits") else out[0]
        kept.append(logits[0, -1].detach().float().cpu())

    layers = list(range(n_layers + 1))
    with torch.inference_mode(), threads_for(model, len(ids)):
        with hooked([model.register_forward_hook(own_logits)]):
            cap = capture(model, blocks, [ids], [every], layers, masked=False, logits=False)
        residual = torch.stack([cap.residual[layer].cpu() for layer in layers], dim=1)
    model_about = {"model": opened.name, "revision": revision or "", "num_layers": str(n_layers)}
    inner, said = site_tensors(model, ids, sites, residual.dtype)
    return residual, kept[-1] if kept else None, {**model_about, **about, **said}, inner


def site_tensors(
    model: Any, ids: list[int], sites: Sequence[str], dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The sites inside the blocks asked for, at every position: [T, L, H] each (block i at
    index i-1), on the CPU, in the states' `dtype` where it holds them exactly (else float32);
    resid_mid too with attn_out or mlp_out where the blocks have one (their changes are read
    against it). And the metadata that names them, with each block's split."""
    import json

    import torch

    from embedlens.analysis.lens.sites import PIECE, take_apart

    if tuple(sites) == ("resid",):
        return {}, {}
    pieces = take_apart(model, ids, range(len(ids)), "resid_mid" in sites)
    blocks = sorted(pieces.post)
    mid = len(pieces.mid) == len(blocks)
    held = [s for s in PIECE if (s in sites and s != "resid") or (s == "resid_mid" and mid)]
    out: dict[str, torch.Tensor] = {}
    for site in held:
        part = getattr(pieces, PIECE[site])
        full = torch.stack([part[layer].cpu() for layer in blocks], dim=1)
        small = full.to(dtype)
        out[site] = small if small.float().equal(full) else full
    splits = [[s.parallel, s.attn, s.mlp, s.error, s.tolerance] for _, s in
              sorted(pieces.splits.items())]  # fmt: skip
    return out, {"sites": ",".join(held), "block_splits": json.dumps(splits)}


def saving_many(
    path: Any, revision: str | None, against: object, session: object, many: str = "--prompts"
) -> tuple[Any, str | None] | None:
    """Where --save-states writes with `many` (--prompts, --text): a folder, checked now
    (refused: a file) and made if missing, by rank 0 alone."""
    if path is None:
        return None
    if against is not None:
        raise UsageError("--save-states and --against do not combine: save each model's alone")
    folder = Path(path)
    if getattr(session, "rank", 0) != 0:
        return path, revision
    if folder.exists() and not folder.is_dir():
        each = "window" if many == "--text" else "prompt"
        raise UsageError(
            f"--save-states '{folder}' is a file: with {many} it names a folder, where each "
            f"{each}'s states go in a file of its own"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EmbedlensError(f"cannot make the folder '{folder}': {e.strerror or e}") from e
    return path, revision


class ManySaver:
    """`lens --prompts --save-states DIR`: each prompt's states, written to DIR as its window
    runs. Under torchrun (`keep`: a rank other than 0) they are kept until the round's end, then
    sent to rank 0 one prompt at a time, which writes them: rank 0 holds at most one prompt's
    states from each rank at once, each other rank its own window's."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        opened: Opened,
        revision: str | None,
        sites: Sequence[str] = ("resid",),
    ):
        self.folder = Path(path)  # made by `lens_prompts` (on rank 0)
        self.opened, self.revision, self.sites = opened, revision, sites
        self.kept: list[tuple[int, list[int], States]] = []
        self.keep = False

    def add(self, line: PromptLine, ask: Ask, run: Prompt) -> None:
        """One prompt's states, in the file of its line."""
        about = {**prompt_about(run, ask), "line": str(line.line)}
        if line.id is not None:
            about["id"] = str(line.id)
        self.put(line.line, run.ids, about)

    def put(self, number: int, ids: list[int], about: dict[str, str]) -> None:
        """The states of `ids` (`about`: their metadata), in file `number`: written now, or
        kept for rank 0 under torchrun."""
        item = (number, ids, states_of(self.opened, ids, self.revision, about, self.sites))
        if self.keep:
            self.kept.append(item)
        else:
            self._write(item)

    def hand_on(self, session: Session) -> None:
        """The states the other ranks kept this round, sent to rank 0 one prompt from each at
        a time and written there (every rank calls this)."""
        counts = session.all_gather(len(self.kept))
        for i in range(max(counts)):
            parts = session.gather(self.kept[i] if i < len(self.kept) else None)
            for item in parts or []:
                if item is not None:
                    self._write(item)
        self.kept.clear()

    def _write(self, item: tuple[int, list[int], States]) -> None:
        line, ids, (residual, logits, about, sites) = item
        path = self.folder / f"{line:06d}.safetensors"  # the prompt on `line` (window `line`)
        save_states(path, residual, ids, logits, about, sites)
