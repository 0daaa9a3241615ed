"""The two sides of a parity run (`parity_run`): states files and folders read and paired, a
model run here on every sequence, and the sequences made from a prompt, a prompts file or a
text's windows."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

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


@dataclass(frozen=True)
class Files:
    """A side read from states files: one per sequence, paired by name with the other side's."""

    where: Path
    files: dict[str, StatesFile]


def open_files(path: str | os.PathLike[str], state_layers: str | None, what: str) -> Files:
    """A states file, or a folder of them (its `*.safetensors`, by name)."""
    from embedlens.analysis.lens.states_file import open_states

    where = Path(path)
    if where.is_dir():
        names = sorted(p.name for p in where.glob("*.safetensors"))
        if not names:
            raise UsageError(f"{what} '{where}' holds no .safetensors file")
        return Files(where, {n: open_states(where / n, state_layers) for n in names})
    if not where.is_file():
        raise UsageError(f"{what} '{where}' is not a file or a folder")
    return Files(where, {where.name: open_states(where, state_layers)})


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


def check_files(fa: StatesFile, fb: StatesFile) -> None:
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


def file_stack(name: str, file: StatesFile) -> Stack:
    """A states file's sequence, every layer read when asked for."""
    every = list(range(file.n_tokens))
    return Stack(
        name,
        file.token_ids(),
        list(file.layers),
        lambda layer: file.finite_rows(layer, every),
        file.logits(),
    )


def live_stacks(name: str, load: LoadOptions, seqs: list[Seq], revision: str | None) -> list[Stack]:
    """Every sequence run through the model `name` loaded as `load` says: each layer at every
    position and its logits at the last, on the CPU (the model freed afterwards)."""
    from embedlens.analysis.lens import options as checks
    from embedlens.analysis.lens.opening import open_model
    from embedlens.analysis.lens.states_file import states_of

    out = []
    with open_model(name, None, checks.loading(name, load), lambda *_: None) as (opened, _):
        for seq in seqs:
            residual, logits, _, _ = states_of(opened, seq.ids, revision, {})
            out.append(held(seq, residual, logits))
    return out


def held(seq: Seq, residual: torch.Tensor, logits: torch.Tensor | None) -> Stack:
    layers = list(range(residual.shape[1]))
    return Stack(seq.name, seq.ids, layers, lambda layer: residual[:, layer], logits)


def sequences(
    inp: Input, asked: LensOptions, tokenizer: Any, config: Any, source: Any
) -> list[Seq]:
    """The input's sequences, tokenised as the lens runs them (before any weight is read)."""
    from embedlens.analysis.lens import options as checks
    from embedlens.analysis.lens.opening import _template_name, make_prompt

    template = _template_name(source)
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
