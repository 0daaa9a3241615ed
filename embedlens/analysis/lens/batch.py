"""Many prompts through the engine at once: one forward pass per batch, rows decoded together,
with the KL and entropy statistics of every row.

Prompts of similar length go together (`batches`), padded on the right with an attention mask
(`capture.capture`), so every row read equals the single-prompt run's up to float32 rounding.
Each prompt is self-checked as in `engine.run_lens`; a prompt whose check fails in the batch is
run again on its own (`run_lens`), which retries with the full tail and names the suspect step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from embedlens.analysis.lens.blocks import (
    Decoder,
    ModelDecoder,
    capture,
    find_blocks,
    input_device,
    threads_for,
)
from embedlens.analysis.lens.engine import (
    Check,
    Kept,
    LensResult,
    Row,
    check_decoded,
    decoded,
    kept_rows,
    run_lens,
    tolerance,
)
from embedlens.analysis.lens.ranking import Top, rowdot, tops_from_log_softmax
from embedlens.analysis.lens.stats import next_ids

BATCH_TOKENS = 512
"""Padded tokens per forward pass, at most (a prompt longer than this runs alone): prompts of
similar length go together, so little of a pass is padding."""
CHUNK_BYTES = 128 * 2**20
"""Decoded logits reduced at once (float32 bytes); the reduction holds a few such arrays."""

KL = dict[tuple[int, int], tuple[float, float]]
"""(layer, position) -> (KL of the model's output from the lens's, the lens's entropy)."""


@dataclass(frozen=True)
class BatchItem:
    """One prompt to run: its ids, the absolute positions to read, its target's id."""

    ids: list[int]
    positions: list[int]
    target: int | None
    read: int | None = None
    """The position whose rows hold the top-k (None: every position); the others hold their
    top-1 and the target only."""
    other: dict[int, torch.Tensor] | None = None
    """With `keep`: another model's residual at these positions (layer -> [P, d]), decoded
    through this model's decoder beside its own rows (`engine.Kept.other`)."""


@dataclass(frozen=True)
class BatchOut:
    """One prompt's result, with (KL, entropy) per (layer, position) and the model's top-1 at
    each position."""

    result: LensResult
    kl: KL
    model_top1: dict[int, int]


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
    """Runs the lens on batches of prompts of one model, its decoder (and the steps after the
    last block) found once.

    The forward pass runs on one CPU thread for small work, on torch's own setting otherwise
    (`threads.threads_for`: from the work's size, never from the machine's load)."""

    def __init__(
        self,
        model: nn.Module,
        layers: Sequence[int],
        k: int,
        real_vocab: int,
        keep: bool = False,
        wrap: Callable[[Decoder], Decoder] | None = None,
    ) -> None:
        """`keep`: what a comparison needs is kept (`engine.Kept`); `wrap`: builds the decoder
        on the model's own (a tuned lens); None: the model's."""
        self.model = model
        self.wrap = wrap
        self.blocks = find_blocks(model)
        self.n_layers = len(self.blocks.modules)
        self.layers = sorted(set(layers))
        self.k = k
        self.real_vocab = real_vocab
        self.decoder: Decoder | None = None
        self.keep = keep
        """Each result keeps what a comparison with another model needs (`engine.Kept`)."""

    def run(self, items: Sequence[BatchItem]) -> list[BatchOut]:
        """Every item's rows and statistics, in the order given."""
        outs: dict[int, BatchOut] = {}
        for group in batches([len(item.ids) for item in items]):
            chosen = [items[i] for i in group]
            for i, out in zip(group, self._run_group(chosen), strict=True):
                outs[i] = out
        return [outs[i] for i in range(len(items))]

    def _run_group(self, items: list[BatchItem]) -> list[BatchOut]:
        n_tokens = sum(len(item.ids) for item in items)
        with torch.inference_mode(), threads_for(self.model, n_tokens):
            decoded = self._decode(items)
        if decoded is None:  # the model's own logits are not finite: each alone says where
            return [self._alone(item) for item in items]
        outs = []
        for item, (result, kl, top1) in zip(items, decoded, strict=True):
            if not result.check.ok:
                result = self._alone(item).result  # the single run names the suspect step
            outs.append(BatchOut(result, kl, top1))
        return outs

    def _alone(self, item: BatchItem) -> BatchOut:
        """One prompt on its own (`run_lens`), its statistics from a batch of one."""
        result = run_lens(
            self.model,
            item.ids,
            layers=self.layers,
            positions=item.positions,
            k=self.k,
            real_vocab=self.real_vocab,
            target=item.target,
            full_at=None if item.read is None else [item.read],
            keep=self.keep,
            other=item.other,
            decoder=None if self.wrap is None else self._new_decoder(item.ids[0]),
        )
        with torch.inference_mode():
            decoded = self._decode([item])
        assert decoded is not None
        return BatchOut(result, decoded[0][1], decoded[0][2])

    def _decode(self, items: list[BatchItem]) -> list[tuple[LensResult, KL, dict[int, int]]] | None:
        """Capture and decode a batch; None when the model's own logits are not finite."""
        model = self.model
        wanted = sorted(set(self.layers) | {self.n_layers})
        reads = [item.positions for item in items]
        cap = capture(model, self.blocks, [item.ids for item in items], reads, wanted)
        assert cap.logits is not None
        real = cap.logits
        if not bool(torch.isfinite(real).all()):
            return None
        if self.decoder is None:
            self.decoder = self._new_decoder(items[0].ids[0])
        decoder = self.decoder
        device = input_device(model)
        job = _Decode(self, items, real, cap.residual)
        job.run(decoder, device)
        steps = decoder.steps(cap.residual[self.n_layers][0].to(device), job.tol)
        return [job.result(b, steps, decoder.full) for b in range(len(items))]

    def _new_decoder(self, dummy_id: int) -> Decoder:
        """The model's own decoder, or the one `wrap` builds on it."""
        own = ModelDecoder(self.model, self.blocks, dummy_id=dummy_id)
        return own if self.wrap is None else self.wrap(own)


class _Decode:
    """Every (prompt, layer, position) row of a batch through the decoder, in bounded chunks,
    reduced to its top-k and its KL and entropy."""

    def __init__(
        self,
        lens: BatchLens,
        items: list[BatchItem],
        real: torch.Tensor,
        residual: dict[int, torch.Tensor],
    ) -> None:
        self.lens = lens
        self.items = items
        self.real = real
        """The model's own logits, [N, V]: row r is (prompt, position) number r of the batch."""
        self.residual = residual
        """The captured residual stream, layer -> [N, d]."""
        self.where = [(b, p) for b, item in enumerate(items) for p in item.positions]
        self.first = [self.where.index((b, item.positions[0])) for b, item in enumerate(items)]
        """Each prompt's first row (its rows are consecutive)."""
        self.rows: list[dict[tuple[int, int], Top]] = [{} for _ in items]
        self.kl: list[KL] = [{} for _ in items]
        self.diff = [0.0] * len(items)
        self.agrees = [True] * len(items)
        self.top1: list[dict[int, int]] = [{} for _ in items]
        self.tol = tolerance(next(lens.model.parameters()).dtype, real)
        self.ref_log = torch.log_softmax(real, dim=-1)
        """The model's own log-probabilities at each row: KL is taken against them."""
        self.ref_prob = self.ref_log.exp()
        self.negent = rowdot(self.ref_prob, self.ref_log)
        """Σ p log p of the model's output at each row (minus its entropy)."""
        self.kept: list[Kept] = [Kept({}, {}, {}) for _ in items]
        self.other = _other_rows(items)

    def run(self, decoder: Decoder, device: torch.device) -> None:
        lens = self.lens
        n_rows = range(len(self.where))
        order = [(layer, r) for layer in lens.layers if layer != lens.n_layers for r in n_rows]
        order += [(lens.n_layers, r) for r in n_rows]
        vocab = int(self.real.shape[-1])
        for part, out in decoded(decoder, self.residual, order, CHUNK_BYTES, vocab, device):
            if not self._take(part, out):
                check_decoded(out, part, lambda r: self.where[r][1])
            if lens.keep:
                self._keep(decoder, part, out, device)
        targets = [self.items[b].target for b, _ in self.where]
        tops = self._tops(self.where, self.real, self.ref_log, targets)
        for r, ((b, p), top) in enumerate(zip(self.where, tops, strict=True)):
            self.top1[b][p] = top.ids[0]
            if lens.n_layers in lens.layers:
                self.rows[b][(lens.n_layers, p)] = top
                self.kl[b][(lens.n_layers, p)] = (0.0, -float(self.negent[r]))

    def _vocab(self) -> int:
        return min(self.lens.real_vocab, int(self.real.shape[-1]))

    def _keep(
        self, decoder: Decoder, part: list[Row], out: torch.Tensor, device: torch.device
    ) -> None:
        """Keep every row of the chunk for a comparison, and the other model's rows through
        this decoder in the same chunk."""
        keys = [(self.where[r][0], (layer, self.where[r][1])) for layer, r in part]
        own, other = kept_rows(decoder, part, out, keys, self.other, device)
        for (b, key), row in own:
            self.kept[b].logits[key] = row
        for (b, key), row in other:
            self.kept[b].other[key] = row

    def _take(self, part: list[Row], out: torch.Tensor) -> bool:
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
        negent = rowdot(lx.exp(), lx)
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
        """The ranking of each (prompt, position) row: the top-k at its prompt's position read,
        the top-1 elsewhere (with the target in both)."""
        k, vocab = self.lens.k, self._vocab()
        full = [j for j, (b, p) in enumerate(where) if self.items[b].read in (None, p)]
        nexts = [next_ids(self.items[b].ids, [p])[0] for b, p in where]
        if k == 1 or len(full) == len(where):
            return tops_from_log_softmax(x, lx, k, vocab, targets, nexts)
        tops = tops_from_log_softmax(x, lx, 1, vocab, targets, nexts)
        if full:
            chosen = tops_from_log_softmax(
                x[full], lx[full], k, vocab, [targets[j] for j in full], [nexts[j] for j in full]
            )
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
            out[j:end] = rowdot(p, lx[j:end])
            j = end
        return out

    def result(self, b: int, steps: list[str], full: bool) -> tuple[LensResult, KL, dict[int, int]]:
        """Prompt b's result, its statistics and the model's top-1 at each position."""
        lens = self.lens
        suspect = None if self.diff[b] <= self.tol else "the steps after the last block"
        start = self.first[b]
        end = start + len(self.items[b].positions)
        kept = None
        if lens.keep:
            residual = {layer: rows[start:end] for layer, rows in self.residual.items()}
            kept = Kept(self.kept[b].logits, self.kept[b].other, residual)
        result = LensResult(
            num_layers=lens.n_layers,
            vocab_size=int(self.real.shape[-1]),
            positions=list(self.items[b].positions),
            layers=lens.layers,
            rows=self.rows[b],
            check=Check(self.diff[b], self.tol, self.agrees[b], suspect),
            steps=steps,
            full_tail=full,
            output=self.real[start:end],
            kept=kept,
        )
        return result, self.kl[b], self.top1[b]


def _other_rows(items: list[BatchItem]) -> dict[int, torch.Tensor] | None:
    """The other model's residual at every row of the batch, in the batch's order (None unless
    every item has one)."""
    if not items or any(item.other is None for item in items):
        return None
    layers = items[0].other or {}
    return {layer: torch.cat([(item.other or {})[layer] for item in items]) for layer in layers}
