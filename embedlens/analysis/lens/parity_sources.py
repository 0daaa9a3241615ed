"""The two sides of a parity run (`parity_run`): states files and folders read and paired, a
model run here on every sequence, and the sequences made from a prompt, a prompts file or a
text's windows."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from embedlens.analysis.lens.parity import Stack
from embedlens.errors import UsageError

if TYPE_CHECKING:
    import torch

    from embedlens.analysis.lens.states_file import StatesFile
    from embedlens.model.prompts import PromptSource
    from embedlens.options import LensOptions, LoadOptions


@dataclass(frozen=True)
class Seq:
    """One sequence compared: its name, ids, and the positions compared at every layer."""

    name: str
    ids: list[int]
    positions: list[int]


@dataclass(frozen=True)
class TextAsk:
    """--text and how it is cut (`text.rule`'s options)."""

    path: str | os.PathLike[str]
    ctx: int = 512
    stride: int | None = None
    score: str = "half"
    max_tokens: int | None = None


@dataclass(frozen=True)
class Input:
    """Where the sequences come from when no side is a states file: one of these."""

    prompt: str | None = None
    prompts: PromptSource | None = None
    text: TextAsk | None = None


Held: TypeAlias = "StatesFile | TorchStates"
"""A states file a parity side reads: safetensors (embedlens', vLLM's, plain) or torch's."""


@dataclass(frozen=True)
class Files:
    """A side read from states files: one per sequence, paired by name with the other side's."""

    where: Path
    files: dict[str, Held]


TORCH_SUFFIXES = (".pt", ".pth")
"""A states file by these names is a plain one torch.save wrote (`TorchStates`)."""


def open_files(path: str | os.PathLike[str], state_layers: str | None, what: str) -> Files:
    """A states file, or a folder of them (its `*.safetensors`, `*.pt` and `*.pth`, by name)."""
    where = Path(path)
    if where.is_dir():
        names = sorted(p.name for p in where.iterdir() if _states_name(p))
        if not names:
            raise UsageError(f"{what} '{where}' holds no .safetensors or .pt file")
        return Files(where, {n: _open_one(where / n, state_layers) for n in names})
    if not where.is_file():
        raise UsageError(f"{what} '{where}' is not a file or a folder")
    return Files(where, {where.name: _open_one(where, state_layers)})


def _states_name(path: Path) -> bool:
    return path.is_file() and path.suffix in (".safetensors", *TORCH_SUFFIXES)


def _open_one(path: Path, state_layers: str | None) -> Held:
    from embedlens.analysis.lens.states_file import open_states

    if path.suffix in TORCH_SUFFIXES:
        return open_torch_states(path, state_layers)
    return open_states(path, state_layers)


@dataclass(frozen=True)
class TorchStates:
    """A plain states file `torch.save` wrote (docs/parity.md): read whole, weights-only. It
    answers what a parity run asks of a `StatesFile`."""

    path: Path
    ids: list[int]
    hidden: torch.Tensor
    """[T, N, H]."""
    layers: list[int]

    @property
    def n_tokens(self) -> int:
        return len(self.ids)

    @property
    def hidden_size(self) -> int:
        return int(self.hidden.shape[-1])

    @property
    def dtype(self) -> str:
        return str(self.hidden.dtype).removeprefix("torch.")

    def token_ids(self) -> list[int]:
        return self.ids

    def finite_rows(self, layer: int, positions: list[int]) -> torch.Tensor:
        import torch

        rows = self.hidden[positions, self.layers.index(layer)]
        if not bool(torch.isfinite(rows.float()).all()):
            raise UsageError(
                f"'{self.path.name}' holds a state that is not finite at layer {layer}"
            )
        return rows

    def logits(self) -> None:
        return None


def open_torch_states(path: Path, state_layers: str | None) -> TorchStates:
    """A plain torch file: a dict of `token_ids` [T] (integers), `hidden_states` [T, N, H]
    (floats) and, unless --state-layers gives them, `layers` [N] (integers)."""
    import torch

    from embedlens.analysis.lens.states_file import parse_layers
    from embedlens.errors import CheckpointError
    from embedlens.io.torchzip import weights_only

    what = "a plain states file holds token_ids, hidden_states and layers"
    data = weights_only(str(path), what)
    name = path.name
    ids, hidden = (
        data.get(k) if isinstance(data, dict) else None for k in ("token_ids", "hidden_states")
    )
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or not hidden.is_floating_point():
        raise CheckpointError(
            f"'{name}' is no plain states file: {what}, hidden_states floats [T, N, H]"
        )
    ids = torch.as_tensor(ids) if ids is not None else None
    if ids is None or ids.dim() != 1 or ids.is_floating_point() or len(ids) != hidden.shape[0]:
        raise CheckpointError(
            f"'{name}': token_ids must be integers, one per token of hidden_states"
        )
    own = data.get("layers")
    if (own is None) == (state_layers is None):
        raise UsageError(
            f"'{name}' "
            + (
                "states its layers: --state-layers applies to files that do not"
                if own is not None
                else "does not say which layers its states are: give them with --state-layers"
            )
        )
    spec = state_layers or ",".join(str(int(x)) for x in torch.as_tensor(own).tolist())
    layers = parse_layers(spec, "--state-layers" if state_layers else name)
    if len(layers) != hidden.shape[1]:
        raise UsageError(
            f"'{name}': {len(layers)} layers named, but hidden_states holds {hidden.shape[1]}"
        )
    return TorchStates(path, [int(i) for i in ids.tolist()], hidden, layers)


def paired(a: Files, b: Files) -> list[tuple[str, str]]:
    """The two sides' files, sequence by sequence: one file each, or two folders of the same
    names (a folder against a file: the folder's file of the file's name); refused when they
    are not the same sequences."""
    if not a.where.is_dir() and not b.where.is_dir():
        return [(next(iter(a.files)), next(iter(b.files)))]
    if set(a.files) != set(b.files):
        only = sorted(set(a.files) ^ set(b.files))[0]
        side = "A" if only in a.files else "B"
        raise UsageError(
            f"the two sides do not hold the same prompts: '{only}' is only in {side}'s "
            f"('{a.where}' and '{b.where}' must hold a file of each name)"
        )
    return [(n, n) for n in a.files]


def check_files(fa: Held, fb: Held) -> None:
    """Two files of one sequence: the same ids, width and layers."""
    names = f"'{fa.path.name}' (A) and '{fb.path.name}' (B)"
    if fa.hidden_size != fb.hidden_size:
        raise UsageError(
            f"{names} hold states of widths {fa.hidden_size} and {fb.hidden_size}: they are not "
            "the same model's"
        )
    if sorted(fa.layers) != sorted(fb.layers):
        raise UsageError(
            f"{names} hold {len(fa.layers)} and {len(fb.layers)} layers ({span(fa.layers)} "
            f"and {span(fb.layers)}): compare files of the same layers"
        )
    check_ids(fa.token_ids(), fb.token_ids(), names)


def check_ids(a: list[int], b: list[int], names: str) -> None:
    """The same token ids on both sides, else where they part."""
    if a == b:
        return
    if len(a) != len(b):
        raise UsageError(f"{names} hold {len(a)} and {len(b)} tokens: not the same prompt")
    at = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    raise UsageError(
        f"{names} hold different token ids from position {at} ({a[at]} and {b[at]}): not the "
        "same prompt"
    )


def span(layers: list[int]) -> str:
    return f"{min(layers)}..{max(layers)}" if layers else "none"


def file_stack(name: str, file: Held) -> Stack:
    """A states file's sequence, every layer read when asked for."""
    every = list(range(file.n_tokens))
    sites = tuple(getattr(file, "sites", ("resid",)))[1:]

    def site_rows(site: str, layer: int) -> torch.Tensor:
        return file.finite_rows(layer, every, site)  # type: ignore[call-arg]

    return Stack(
        name,
        file.token_ids(),
        list(file.layers),
        lambda layer: file.finite_rows(layer, every),
        file.logits(),
        sites,
        site_rows if sites else None,
    )


KEPT_BYTES = 1 << 30
"""B's states a model run keeps in memory; past this, they wait in a temporary folder."""


def live_stacks(
    name: str,
    load: LoadOptions,
    seqs: list[Seq],
    revision: str | None,
    sites: tuple[str, ...],
    spill: Path,
) -> list[Stack]:
    """Every sequence run through the model `name` loaded as `load` says: each layer at every
    position and its logits at the last, on the CPU (the model freed afterwards); held in
    memory, or once they pass KEPT_BYTES written to the folder `spill` (a file a sequence, read
    back by row as a states file)."""
    from embedlens.analysis.lens import options as checks
    from embedlens.analysis.lens.opening import open_model
    from embedlens.analysis.lens.states_file import open_states, save_states, states_of

    out, kept = [], 0
    with open_model(name, None, checks.loading(name, load), lambda *_: None) as (opened, _):
        for i, seq in enumerate(seqs):
            residual, logits, about, inner = states_of(opened, seq.ids, revision, {}, sites)
            kept += sum(t.numel() * t.element_size() for t in (residual, *inner.values()))
            if kept <= KEPT_BYTES:
                out.append(held(seq, residual, logits, inner))
                continue
            path = spill / f"{i:06d}.safetensors"
            save_states(path, residual, seq.ids, logits, about, inner)
            out.append(file_stack(seq.name, open_states(path, None)))
    return out


def held(
    seq: Seq, residual: torch.Tensor, logits: torch.Tensor | None, inner: dict[str, torch.Tensor]
) -> Stack:
    """A model run's sequence, kept in memory (`inner`: its sites inside the blocks)."""
    layers = list(range(residual.shape[1]))

    def site_rows(site: str, layer: int) -> torch.Tensor:
        return inner[site][:, layer - 1]

    sites = tuple(inner)
    return Stack(
        seq.name,
        seq.ids,
        layers,
        lambda layer: residual[:, layer],
        logits,
        sites,
        site_rows if sites else None,
    )


def sequences(
    inp: Input, asked: LensOptions, tokenizer: Any, config: Any, source: Any
) -> list[Seq]:
    """The input's sequences, tokenised as the lens runs them (before any weight is read)."""
    from embedlens.analysis.lens import options as checks
    from embedlens.analysis.lens.opening import make_prompt, template_name

    template = template_name(source)
    if inp.text is not None:
        return _windows(inp.text, tokenizer)
    if inp.prompt is not None:
        run = make_prompt(checks.ask(inp.prompt, asked), tokenizer, config, template)
        return [Seq("prompt", run.ids, list(range(len(run.ids))))]
    assert inp.prompts is not None
    from embedlens.analysis.lens.many import prepare_line
    from embedlens.model.prompts import BadLine

    ask, out = checks.many(asked, None), []
    for line in inp.prompts:
        if isinstance(line, BadLine):
            raise line
        ids = prepare_line(line, ask, tokenizer, config, template)[1].ids
        name = f"line {line.line}" if line.id is None else str(line.id)
        out.append(Seq(name, ids, list(range(len(ids)))))
    if not out:
        raise UsageError("--prompts holds no prompt")
    return out


def _windows(t: TextAsk, tokenizer: Any) -> list[Seq]:
    from embedlens.analysis.lens.text import read_text, rule, tokenise, windows

    r = rule(t.ctx, t.stride, t.score, t.max_tokens)
    tokens = tokenise(read_text(t.path), tokenizer, r, os.fspath(t.path))
    return [Seq(f"window {w.index + 1}", w.ids, w.positions) for w in windows(r, tokens)]
