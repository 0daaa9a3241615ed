"""The logit lens on a batch of prompts: one forward pass, rows decoded together, statistics kept.

Prompts of different lengths are padded on the right, with an attention mask: in a causal model a
real token never attends to the padding after it, and its position ids are those of a single run,
so every row read equals the single-prompt run's up to float32 rounding. Each prompt is
self-checked as in `run_lens`; a prompt whose check fails in the batch is run again on its own
(`run_lens`), which retries with the full tail and names the suspect step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from embedlens.analysis.lens_engine import (
    Blocks,
    Check,
    LensResult,
    Tail,
    Top,
    _best_ids,
    _check_decoded,
    _first_tensor,
    _hooks,
    _threads_for,
    find_blocks,
    input_device,
    one_thread,
    post_head_step,
    run_lens,
    tail_steps,
    tolerance,
)
from embedlens.errors import UnsupportedError
from embedlens.runtime import OthersBusy

BATCH_TOKENS = 512
"""Padded tokens per forward pass, at most (a prompt longer than this runs alone): prompts of
similar length go together, so little of a pass is padding."""
CHUNK_BYTES = 128 * 2**20
"""Decoded logits reduced at once (float32 bytes); the reduction holds a few such arrays."""


@dataclass(frozen=True)
class BatchItem:
    """One prompt to run: its ids, the absolute positions to read, its target's id."""

    ids: list[int]
    positions: list[int]
    target: int | None
    read: int | None = None
    """The position whose rows hold the top-k (None: every position); the others hold their
    top-1 and the target only."""


@dataclass(frozen=True)
class BatchOut:
    """One prompt's result, with (KL, entropy) per (layer, position) and the model's top-1 at
    each position."""

    result: LensResult
    kl: dict[tuple[int, int], tuple[float, float]]
    model_top1: dict[int, int]


def batch_threads(
    model: nn.Module, n_tokens: int, others_busy: Callable[[], float]
) -> AbstractContextManager[None]:
    """One CPU thread while other processes already keep as many cores busy as torch would use
    (`others_busy()`, a `runtime.OthersBusy`: this process's own work not counted, asked only
    for large work), and for small work (`_threads_for`): every one of a forward pass's hundreds
    of ops ends in a barrier that then waits for a time slice. Measured on 2 cores at load 4.0
    to 5.8, 100 prompts on SmolLM2: 60 s wall and 40 s CPU on one thread, 86 to 97 s and 56 to
    63 s on two."""
    return _threads_for(model, n_tokens, others_busy)


def batches(lengths: Sequence[int], budget: int = BATCH_TOKENS) -> list[list[int]]:
    """Indices grouped so that each group's padded size (count x longest) stays within budget;
    similar lengths go together (less padding)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[i] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


class BatchLens:
    """Runs the lens on batches of prompts of one model, the tail's steps found once."""

    def __init__(self, model: nn.Module, layers: Sequence[int], k: int, real_vocab: int) -> None:
        self.model = model
        self.blocks: Blocks = find_blocks(model)
        self.n_layers = len(self.blocks.modules)
        self.layers = sorted(set(layers))
        self.k = k
        self.real_vocab = real_vocab
        self.steps: list[str] | None = None
        self.tail: Tail | None = None
        self.others_busy = OthersBusy()

    def run(self, items: Sequence[BatchItem]) -> list[BatchOut]:
        """Every item's rows and statistics, in the order given."""
        outs: dict[int, BatchOut] = {}
        for group in batches([len(item.ids) for item in items]):
            chosen = [items[i] for i in group]
            for i, out in zip(group, self._run_group(chosen), strict=True):
                outs[i] = out
        return [outs[i] for i in range(len(items))]

    def _run_group(self, items: list[BatchItem]) -> list[BatchOut]:
        model, n_layers = self.model, self.n_layers
        device = input_device(model)
        wanted = sorted(set(self.layers) | {n_layers})
        n_tokens = sum(len(item.ids) for item in items)
        with torch.inference_mode(), batch_threads(model, n_tokens, self.others_busy):
            residual, real = _capture_batch(model, self.blocks, items, wanted)
            if not bool(torch.isfinite(real).all()):
                return [self._alone(item) for item in items]
            tail = self._tail(items[0].ids[0])
            decoded = self._decode(tail, items, residual, real, device)
        outs = []
        for item, (result, kl, top1) in zip(items, decoded, strict=True):
            if not result.check.ok:
                result = self._alone(item).result  # the single run names the suspect step
            outs.append(BatchOut(result, kl, top1))
        return outs

    def _alone(self, item: BatchItem) -> BatchOut:
        """One prompt on its own (batch of one, `run_lens`), its statistics from a batch of one."""
        result = run_lens(
            self.model,
            item.ids,
            layers=self.layers,
            positions=item.positions,
            k=self.k,
            real_vocab=self.real_vocab,
            target=item.target,
            full_at=None if item.read is None else [item.read],
        )
        return BatchOut(result, *self._stats_alone(item))

    def _stats_alone(
        self, item: BatchItem
    ) -> tuple[dict[tuple[int, int], tuple[float, float]], dict[int, int]]:
        with torch.inference_mode():
            residual, real = _capture_batch(
                self.model, self.blocks, [item], sorted(set(self.layers) | {self.n_layers})
            )
            tail = self._tail(item.ids[0])
            decoded = self._decode(tail, [item], residual, real, input_device(self.model))
        return decoded[0][1], decoded[0][2]

    def _tail(self, dummy_id: int) -> Tail:
        if self.tail is None:
            self.tail = Tail(self.model, self.blocks, dummy_id=dummy_id)
        return self.tail

    def _find_steps(self, tail: Tail, first: torch.Tensor, real: torch.Tensor) -> list[str]:
        """What runs after the last block (found once per model, on one row)."""
        if self.steps is None:
            probe = tail_steps(self.model, self.blocks, tail, first)
            steps = list(probe.steps)
            if probe.head_out is not None and probe.logits is not None:
                tol = tolerance(next(self.model.parameters()).dtype, real)
                post = post_head_step(probe.head_out.float(), probe.logits, tol)
                if post is not None:
                    steps.append(post)
            self.steps = steps
        return self.steps

    def _decode(
        self,
        tail: Tail,
        items: list[BatchItem],
        residual: dict[int, torch.Tensor],
        real: torch.Tensor,
        device: torch.device,
    ) -> list[tuple[LensResult, dict[tuple[int, int], tuple[float, float]], dict[int, int]]]:
        job = _Decode(self, items, real)
        job.run(tail, residual, device)
        steps = self._find_steps(tail, residual[self.n_layers][0].to(device), real)
        return [job.result(b, steps, tail.full) for b in range(len(items))]


class _Decode:
    """Every (prompt, layer, position) row of a batch through the tail, in bounded chunks."""

    def __init__(self, lens: BatchLens, items: list[BatchItem], real: torch.Tensor) -> None:
        self.lens = lens
        self.items = items
        self.real = real
        """The model's own logits, [N, V]: row r is (prompt, position) number r of the batch."""
        self.where = [(b, p) for b, item in enumerate(items) for p in item.positions]
        self.rows: list[dict[tuple[int, int], Top]] = [{} for _ in items]
        self.kl: list[dict[tuple[int, int], tuple[float, float]]] = [{} for _ in items]
        self.diff = [0.0] * len(items)
        self.agrees = [True] * len(items)
        self.top1: list[dict[int, int]] = [{} for _ in items]
        self.tol = tolerance(next(lens.model.parameters()).dtype, real)
        self.ref_log = torch.log_softmax(real, dim=-1)
        """The model's own log-probabilities at each row: KL is taken against them."""
        self.ref_prob = self.ref_log.exp()
        self.negent = _rowdot(self.ref_prob, self.ref_log)
        """Σ p log p of the model's output at each row (minus its entropy)."""

    def run(self, tail: Tail, residual: dict[int, torch.Tensor], device: torch.device) -> None:
        lens = self.lens
        n_rows = range(len(self.where))
        order = [(layer, r) for layer in lens.layers if layer != lens.n_layers for r in n_rows]
        order += [(lens.n_layers, r) for r in n_rows]
        chunk = max(1, CHUNK_BYTES // (4 * int(self.real.shape[-1])))
        for start in range(0, len(order), chunk):
            part = order[start : start + chunk]
            h = torch.stack([residual[layer][r].to(device) for layer, r in part])
            out = tail(h).float()
            if not self._take(part, out):
                _check_decoded(out, part, torch.tensor([self.where[r][1] for _, r in part]))
        targets = [self.items[b].target for b, _ in self.where]
        tops = self._tops(self.where, self.real, self.ref_log, targets)
        for r, ((b, p), top) in enumerate(zip(self.where, tops, strict=True)):
            self.top1[b][p] = top.ids[0]
            if lens.n_layers in lens.layers:
                self.rows[b][(lens.n_layers, p)] = top
                self.kl[b][(lens.n_layers, p)] = (0.0, -float(self.negent[r]))

    def _vocab(self) -> int:
        return min(self.lens.real_vocab, int(self.real.shape[-1]))

    def _take(self, part: list[tuple[int, int]], out: torch.Tensor) -> bool:
        """Keep a chunk's rows and statistics; False when a row is not finite (then nothing
        of the chunk is to be used: the caller raises)."""
        n_layers = self.lens.n_layers
        last = [i for i, (layer, _) in enumerate(part) if layer == n_layers]
        if last and not bool(torch.isfinite(out[last]).all()):
            return False
        for i in last:
            r = part[i][1]
            b = self.where[r][0]
            theirs = self.real[r].to(out.device)
            self.diff[b] = max(self.diff[b], float((out[i] - theirs).abs().max()))
            self.agrees[b] = self.agrees[b] and bool(out[i].argmax() == theirs.argmax())
        keep = [i for i, (layer, _) in enumerate(part) if layer != n_layers]
        if not keep:
            return True
        x = out if len(keep) == len(part) else out[keep]
        refs = torch.tensor([part[i][1] for i in keep])
        lx = torch.log_softmax(x, dim=-1)
        # Σ p log p of each row, as one dot product per row (no [rows, V] product is stored);
        # it is not finite exactly when the row's logits are not (0 · -inf and inf - inf: NaN)
        negent = _rowdot(lx.exp(), lx)
        if not bool(torch.isfinite(negent).all()):
            return False
        targets = [self.items[self.where[part[i][1]][0]].target for i in keep]
        tops = self._tops([self.where[part[i][1]] for i in keep], x, lx, targets)
        cross = self._cross(refs.tolist(), lx)
        kl = (self.negent[refs].to(x.device) - cross).clamp_min(0.0).tolist()
        entropy = (-negent).tolist()
        for j, i in enumerate(keep):
            layer, r = part[i]
            b, p = self.where[r]
            self.rows[b][(layer, p)] = tops[j]
            self.kl[b][(layer, p)] = (kl[j], entropy[j])
        return True

    def _tops(
        self,
        where: list[tuple[int, int]],
        x: torch.Tensor,
        lx: torch.Tensor,
        targets: list[int | None],
    ) -> list[Top]:
        """`top_rows` of each (prompt, position) row: the top-k at its prompt's position read,
        the top-1 elsewhere (with the target in both)."""
        k, vocab = self.lens.k, self._vocab()
        full = [j for j, (b, p) in enumerate(where) if self.items[b].read in (None, p)]
        if k == 1 or len(full) == len(where):
            return top_rows(x, lx, k, vocab, targets)
        tops = top_rows(x, lx, 1, vocab, targets)
        if full:
            chosen = top_rows(x[full], lx[full], k, vocab, [targets[j] for j in full])
            for j, top in zip(full, chosen, strict=True):
                tops[j] = top
        return tops

    def _cross(self, refs: list[int], lx: torch.Tensor) -> torch.Tensor:
        """Σ p log q of each row: p the model's output at row refs[j], log q row j of `lx`.
        A chunk reads the model's rows in runs of consecutive rows (one layer's rows in order),
        so each run multiplies a slice of them: no [rows, V] copy of the model's rows."""
        out = torch.empty(len(refs), dtype=lx.dtype, device=lx.device)
        j = 0
        while j < len(refs):
            end = j + 1
            while end < len(refs) and refs[end] == refs[end - 1] + 1:
                end += 1
            p = self.ref_prob[refs[j] : refs[j] + end - j].to(lx.device)
            out[j:end] = _rowdot(p, lx[j:end])
            j = end
        return out

    def result(
        self, b: int, steps: list[str], full: bool
    ) -> tuple[LensResult, dict[tuple[int, int], tuple[float, float]], dict[int, int]]:
        lens = self.lens
        suspect = None if self.diff[b] <= self.tol else "the steps after the last block"
        result = LensResult(
            num_layers=lens.n_layers,
            vocab_size=int(self.real.shape[-1]),
            positions=list(self.items[b].positions),
            layers=lens.layers,
            rows=self.rows[b],
            check=Check(self.diff[b], self.tol, self.agrees[b], suspect),
            steps=steps,
            full_tail=full,
        )
        return result, self.kl[b], self.top1[b]


def _capture_batch(
    model: nn.Module, blocks: Blocks, items: Sequence[BatchItem], layers: Sequence[int]
) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """One forward pass over the prompts padded on the right: the residual at each layer and the
    model's logits, at every (prompt, position) read, in that order ([N, d] and [N, V])."""
    device = input_device(model)
    width = max(len(item.ids) for item in items)
    ids = torch.full((len(items), width), items[0].ids[0], dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for b, item in enumerate(items):
        ids[b, : len(item.ids)] = torch.tensor(item.ids)
        mask[b, : len(item.ids)] = 1
    bi = torch.tensor([b for b, item in enumerate(items) for _ in item.positions])
    pi = torch.tensor([p for item in items for p in item.positions])
    residual: dict[int, torch.Tensor] = {}

    def keep(layer: int) -> Callable[..., None]:
        def hook(_m: nn.Module, _args: Any, out: Any) -> None:
            t = _first_tensor(out)
            if t is None:
                raise UnsupportedError(f"block {layer} returns no tensor the lens can read")
            residual[layer] = t[bi.to(t.device), pi.to(t.device)].detach()

        return hook

    def keep_input(_m: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        t = _first_tensor(args) if args else kwargs.get("hidden_states")
        if not isinstance(t, torch.Tensor):
            raise UnsupportedError("the first block's input is not a tensor the lens can read")
        residual[0] = t[bi.to(t.device), pi.to(t.device)].detach()

    handles: list[Any] = []
    if 0 in layers:
        handles.append(blocks.modules[0].register_forward_pre_hook(keep_input, with_kwargs=True))
    for layer in sorted(set(layers) - {0}):
        handles.append(blocks.modules[layer - 1].register_forward_hook(keep(layer)))
    keep_at = torch.unique(pi)
    with _hooks(handles):
        logits = _forward_masked(model, ids.to(device), mask.to(device), keep_at)
    at = torch.searchsorted(keep_at, pi)
    return residual, logits[bi.to(logits.device), at.to(logits.device)].float()


def _forward_masked(
    model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    """The model's logits at positions `keep` of every row, [batch, len(keep), V]."""
    kwargs: dict[str, Any] = {"use_cache": False, "attention_mask": mask}
    params = inspect.signature(model.forward).parameters
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = keep.to(ids.device)
    out = model(input_ids=ids, **kwargs)
    logits: torch.Tensor = out.logits if hasattr(out, "logits") else out[0]
    if "logits_to_keep" not in params:
        logits = logits[:, keep.to(logits.device)]
    return logits


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ a·b along the last dimension of each row, [n, V] x [n, V] -> [n]. torch's sum adds in
    blocks; a BLAS dot product (bmm) adds 10^5 float32 terms in a row and moved a KL of 99.53
    nats by 0.01 against float64. One row is summed on one thread (`one_thread`): torch splits
    a reduction to a single value between threads, and its last bits would follow their count."""
    if a.shape[0] > 1:
        return (a * b).sum(dim=-1)
    with one_thread():
        return (a * b).sum(dim=-1)


def top_rows(
    x: torch.Tensor, lx: torch.Tensor, k: int, real_vocab: int, targets: Sequence[int | None]
) -> list[Top]:
    """`_top` of the engine for many rows at once: the k best real tokens by logit (equal logits:
    the lower id first), their probabilities and log-probabilities (from `lx`, the rows'
    log_softmax over the whole output), and each row's target with its rank by logit."""
    real = x[:, :real_vocab]
    kk = min(k, real_vocab)
    # one more than asked: equal logits across the k-th place show as the next one being equal
    values, idx = real.topk(min(kk + 1, real_vocab), dim=-1)
    ties = (values[:, kk] == values[:, kk - 1]).tolist() if kk < real_vocab else [False] * len(x)
    values, idx = values[:, :kk], idx[:, :kk]
    by_id = idx.sort(dim=-1).values
    order = torch.sort(real.gather(1, by_id), dim=-1, descending=True, stable=True).indices
    best = by_id.gather(1, order)
    for r in (r for r, tied in enumerate(ties) if tied):  # equal logits across the k-th place
        best[r] = _best_ids(real[r], values[r, -1], kk)
    best_lp = lx.gather(1, best)
    ids, logprobs, probs = best.tolist(), best_lp.tolist(), best_lp.exp().tolist()
    at = _targets(x, lx, real, targets)
    return [
        Top(ids[r], probs[r], logprobs[r], *at.get(r, (None, None, None)))
        for r in range(x.shape[0])
    ]


def _targets(
    x: torch.Tensor, lx: torch.Tensor, real: torch.Tensor, targets: Sequence[int | None]
) -> dict[int, tuple[float, int, float]]:
    """row -> (probability, rank, log-probability) of its target, for rows that have one."""
    rows = [r for r, t in enumerate(targets) if t is not None]
    if not rows:
        return {}
    tid = torch.tensor([targets[r] for r in rows], device=x.device)
    at = torch.tensor(rows, device=x.device)
    value = x[at, tid][:, None]
    sub = real[at]
    lower = torch.arange(sub.shape[1], device=x.device)[None, :] < tid[:, None]
    rank = ((sub > value).sum(-1) + ((sub == value) & lower).sum(-1) + 1).tolist()
    lp = lx[at, tid]
    probs, logprobs = lp.exp().tolist(), lp.tolist()
    return {r: (probs[j], int(rank[j]), logprobs[j]) for j, r in enumerate(rows)}
