"""The lens engine: capture the residual stream, decode it through a decoder, reduce each row,
check the decoding.

One runner (`BatchLens`) for one prompt (`run_lens`) and for many at once: one forward pass per
batch (`blocks.capture`), rows decoded in bounded chunks (`decoded`), each chunk reduced as it
comes (`stats`: the best tokens, a target's rank, the row statistics; in a batch the KL and
entropy of every row too). A self-check compares the decoding of the last block's output with
the model's real logits, and says which step is suspect if they differ.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from embedlens.analysis.lens.blocks import Decoder, ModelDecoder, capture, find_blocks, threads_for
from embedlens.analysis.lens.options import LayerItem, resolve_layers
from embedlens.analysis.lens.report import (
    Check,
    Kept,
    LensResult,
    kept_rows,
    model_not_finite,
    not_finite,
)
from embedlens.analysis.lens.stats import (
    Reference,
    Top,
    exact_top1,
    exact_tops,
    next_ids,
    tops_from_log_softmax,
)
from embedlens.errors import NumericError, UnsupportedError

CHUNK_BYTES = 256 * 2**20
"""Logits decoded at once by `run_lens` (float32 bytes): rows are decoded in chunks of at most
this size."""
BATCH_CHUNK_BYTES = 128 * 2**20
"""Decoded logits of a batch reduced at once (float32 bytes); the reduction holds a few such
arrays."""
BATCH_TOKENS = 512
"""Padded tokens per forward pass, at most (a prompt longer than this runs alone): prompts of
similar length go together, so little of a pass is padding."""

Row = tuple[int, int]
"""(layer, row of the capture)."""
KL = dict[tuple[int, int], tuple[float, float]]
"""(layer, position) -> (KL of the model's output from the lens's, the lens's entropy)."""
Rows = dict[int, torch.Tensor]
"""Tensors by number: a residual stream's rows by layer ([N, d]), or logits by row ([V])."""


def tolerance(dtype: torch.dtype, logits: torch.Tensor) -> float:
    """The check's tolerance: 1e-3 in float32; in a 16-bit dtype, what its rounding allows at
    these logits' size."""
    if dtype in (torch.float32, torch.float64):
        return 1e-3
    scale = max(1.0, float(logits.abs().max()))
    return max(1e-3, 8 * torch.finfo(dtype).eps * scale)


def decoded(
    decoder: Decoder,
    residual: dict[int, torch.Tensor],
    order: Sequence[Row],
    chunk_bytes: int,
    vocab: int,
    device: torch.device,
) -> Iterator[tuple[list[Row], torch.Tensor]]:
    """The rows `order` through the decoder in chunks of at most `chunk_bytes` of float32 logits
    over `vocab` tokens: each chunk's rows and their logits [n, V], float32."""
    chunk = max(1, chunk_bytes // (4 * vocab))
    for start in range(0, len(order), chunk):
        part = list(order[start : start + chunk])
        yield part, decode_rows(decoder, residual, part, device)


def decode_rows(
    decoder: Decoder, residual: dict[int, torch.Tensor], part: Sequence[Row], device: torch.device
) -> torch.Tensor:
    """The rows `part` of `residual` through the decoder at once: float32 logits [n, V]. The
    same rows in the same chunk give the same bits: a comparison decodes another model's rows
    in the chunks of this one's."""
    h = torch.stack([residual[layer][r].to(device) for layer, r in part])
    return decoder.logits(h, [layer for layer, _ in part]).float()


@dataclass(frozen=True)
class BatchItem:
    """One prompt to run: its ids, the absolute positions to read, its target's id."""

    ids: list[int]
    positions: list[int]
    target: int | None
    read: int | None = None
    """The position whose rows hold the top-k (None: every position); the others hold their
    top-1 (and in a batch the target)."""
    other: dict[int, torch.Tensor] | None = None
    """With `keep`: another model's residual at these positions (layer -> [P, d]), decoded
    through this model's decoder beside its own rows (`Kept.other`)."""


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


def run_lens(
    model: nn.Module,
    input_ids: Sequence[int],
    *,
    layers: Sequence[LayerItem] | None,
    positions: Sequence[int],
    k: int,
    real_vocab: int,
    target: int | None = None,
    full_at: Sequence[int] | None = None,
    decoder: Decoder | None = None,
    keep: bool = False,
    other: dict[int, torch.Tensor] | None = None,
) -> LensResult:
    """Decode `layers` (as `options.resolve_layers` reads them: 0 = embedding output, L = the
    model's output, None: all) at `positions` of one prompt: absolute indices into `input_ids`.
    `real_vocab` is the tokenizer's length: rows past it are padding and never predicted, though
    the softmax runs over every row. `full_at`: the position whose rows hold the top-k and the
    target (all by default); the others hold their top-1 only (a grid's cells), whatever k is.
    `decoder`: the model's own by default. `keep`: the result keeps what a comparison needs
    (`Kept`), with `other` (another model's residual at the same layers and positions, layer ->
    [P, d]) through this decoder."""
    read = None
    if full_at is not None:
        (read,) = {int(p) for p in full_at}  # the position read
    item = BatchItem(list(input_ids), [int(p) for p in positions], target, read, other)
    return BatchLens(model, layers, k, real_vocab, keep, decoder=decoder, exact=True).one(item)


class BatchLens:
    """Runs the lens on prompts of one model, its decoder (and the steps after the last block)
    found once: capture, decode in bounded chunks, reduce each row as it comes, self-check.

    A batch (`run`): prompts of similar length padded on the right with an attention mask (every
    row read equals the single-prompt run's up to float32 rounding), each row's KL and entropy
    kept too. A prompt whose check fails in the batch, or whose model's logits are not finite,
    runs again on its own (`exact`: as a plain call runs it, no mask, the head watched, float64
    log-probabilities), which retries with the full tail, names the suspect step, or says where
    the model stops being finite. The forward pass runs on one CPU thread for small work
    (`blocks.threads_for`: from the work's size, never from the machine's load)."""

    def __init__(
        self,
        model: nn.Module,
        layers: Sequence[LayerItem] | None,
        k: int,
        real_vocab: int,
        keep: bool = False,
        wrap: Callable[[Decoder], Decoder] | None = None,
        *,
        decoder: Decoder | None = None,
        exact: bool = False,
    ) -> None:
        """`keep`: what a comparison needs is kept (`Kept`); `wrap`: builds the decoder on the
        model's own (a tuned lens), `decoder`: the decoder itself; neither: the model's."""
        self.model = model
        self.wrap = wrap
        self.blocks = find_blocks(model)
        self.n_layers = len(self.blocks.modules)
        self.layers = sorted(
            set(resolve_layers(None if layers is None else [*layers], self.n_layers))
        )
        self.k = k
        self.real_vocab = real_vocab
        self.decoder = decoder
        self.keep = keep
        """Each result keeps what a comparison with another model needs (`Kept`)."""
        self.exact = exact
        self.as_batch = not exact
        """Every position's rows kept and ranked (`Kept`, `ROW_STATS`), not the read one's alone:
        a batch, or an `exact` run standing in for one (`_alone`)."""

    def run(self, items: Sequence[BatchItem]) -> list[BatchOut]:
        """Every item's rows and statistics, in the order given."""
        outs: dict[int, BatchOut] = {}
        for group in batches([len(item.ids) for item in items]):
            chosen = [items[i] for i in group]
            for i, out in zip(group, self._run_group(chosen), strict=True):
                outs[i] = out
        return [outs[i] for i in range(len(items))]

    def one(self, item: BatchItem) -> LensResult:
        """One prompt's rows and self-check."""
        with torch.inference_mode(), threads_for(self.model, len(item.ids)):
            decoded = self._decode([item])
        assert decoded is not None
        return decoded[0].result

    def decode(self, item: BatchItem, residual: Rows, vocab: int, held: Rows) -> LensResult:
        """One prompt's rows from a residual stream another source gives (layer -> [P, d]: a
        states file), over `vocab` tokens, with no forward pass and no check: the last layer's
        decoded rows stand for the model's output, but where `held` has it (row -> logits [V])."""
        decoder = self._decoder(item.ids[0])
        job = _Decode(self, [item], None, residual)
        job.vocab, job.held = vocab, held
        job.run(decoder, torch.device("cpu"))
        return job.result(0, [], decoder.full, "").result

    def _run_group(self, items: list[BatchItem]) -> list[BatchOut]:
        n_tokens = sum(len(item.ids) for item in items)
        with torch.inference_mode(), threads_for(self.model, n_tokens):
            decoded = self._decode(items)
        if decoded is None:  # the model's own logits are not finite: each alone says where
            return [self._alone(item) for item in items]
        outs = []
        for item, out in zip(items, decoded, strict=True):
            if not out.result.check.ok:  # the single run names the suspect step
                out = BatchOut(self._alone(item).result, out.kl, out.model_top1)
            outs.append(out)
        return outs

    def _alone(self, item: BatchItem) -> BatchOut:
        """One prompt on its own (`exact`), its statistics from a batch of one."""
        alone = BatchLens(
            self.model, self.layers, self.k, self.real_vocab, self.keep, self.wrap, exact=True
        )
        alone.as_batch = True
        result = alone.one(item)
        with torch.inference_mode():
            decoded = self._decode([item])
        assert decoded is not None
        return BatchOut(result, decoded[0].kl, decoded[0].model_top1)

    def _decode(self, items: list[BatchItem]) -> list[BatchOut] | None:
        """Capture and decode a batch; None when the model's own logits are not finite (one
        prompt run `exact` raises instead, saying where)."""
        model, n_layers = self.model, self.n_layers
        decoder = self._decoder(items[0].ids[0])
        wanted = sorted(set(self.layers) | {n_layers})
        reads = [item.positions for item in items]
        watch = decoder.watch if self.exact else None
        ids = [item.ids for item in items]
        cap = capture(model, self.blocks, ids, reads, wanted, watch, masked=not self.exact)
        assert cap.logits is not None
        real = cap.logits
        if not bool(torch.isfinite(real).all()):
            if not self.exact:
                return None
            raise model_not_finite(model, self.blocks, items[0].ids, reads[0], real)
        target, vocab = items[0].target, int(real.shape[-1])
        if self.exact and target is not None and not 0 <= target < vocab:
            raise UnsupportedError(f"token {target} has no row in the model's output ({vocab})")
        device = cap.device
        assert device is not None
        job = _Decode(self, items, real, cap.residual)
        job.run(decoder, device)
        if self.exact and job.diff[0] > job.tol and not decoder.full:  # a NaN is not retried
            decoder.full = True  # cutting the block list may have changed the tail: run them all
            retry = _Decode(self, items, real, cap.residual)
            retry.run(decoder, device)
            if retry.diff[0] < job.diff[0]:
                job = retry
            else:
                decoder.full = False
        steps = decoder.steps(cap.residual[n_layers][0].to(device), job.tol)
        suspect = "the steps after the last block"
        if self.exact and job.diff[0] > job.tol:
            suspect = decoder.suspect(cap, job.tol)
        return [job.result(b, steps, decoder.full, suspect) for b in range(len(items))]

    def _decoder(self, dummy_id: int) -> Decoder:
        """The decoder, built once (its tail run on `dummy_id`, the first prompt's first id): the
        model's own, or the one `wrap` builds on it."""
        if self.decoder is None:
            own = ModelDecoder(self.model, self.blocks, dummy_id=dummy_id)
            self.decoder = own if self.wrap is None else self.wrap(own)
        return self.decoder


class _Decode:
    """Every (prompt, layer, position) row of a batch through the decoder, in bounded chunks,
    reduced as soon as it is decoded to its top-k (and in a batch its KL and entropy): a layer x
    position grid never holds more than one chunk of logits."""

    def __init__(
        self, lens: BatchLens, items: list[BatchItem], real: torch.Tensor | None, residual: Rows
    ) -> None:
        self.lens = lens
        self.items = items
        self.real = real
        """The model's own logits, [N, V]: row r is (prompt, position) number r of the batch (None:
        the last layer's decoded rows stand for them, `BatchLens.decode`)."""
        self.vocab = 0 if real is None else int(real.shape[-1])
        self.held: Rows = {}
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
        self.tol = 0.0 if real is None else tolerance(next(lens.model.parameters()).dtype, real)
        self.kept: list[Kept] = [Kept({}, {}, {}) for _ in items]
        self.other = _other_rows(items)
        if real is not None and not lens.exact:
            self.ref = Reference(real)
            """The model's own output at each row: KL is taken against it."""

    def run(self, decoder: Decoder, device: torch.device) -> None:
        """Every row decoded and reduced; the last layer's rows are the model's own output (without
        it, their decoding but where `held` has it)."""
        lens, n = self.lens, self.lens.n_layers
        n_rows = range(len(self.where))
        order = [(layer, r) for layer in lens.layers if layer != n for r in n_rows]
        order += [(n, r) for r in n_rows if n in self.residual]
        chunk = CHUNK_BYTES if lens.exact else BATCH_CHUNK_BYTES
        final: Rows = {}
        for part, out in decoded(decoder, self.residual, order, chunk, self.vocab, device):
            check_decoded(out, part, lambda r: self.where[r][1])
            if lens.keep:
                self._keep(decoder, part, out, device)
            if self.real is None:  # the decoded rows stand for the model's output
                final.update((r, out[i]) for i, (layer, r) in enumerate(part) if layer == n)
            self._check(part, out)
            self._take(part, out)
        if self.real is None and len(final) == len(self.where):
            self.real = torch.stack([self.held.get(r, final[r]) for r in n_rows])
        if self.real is None or (lens.exact and n not in lens.layers):
            return
        tops = self._tops(self.where, self.real, None if lens.exact else self.ref.log)
        for r, ((b, p), top) in enumerate(zip(self.where, tops, strict=True)):
            self.top1[b][p] = top.ids[0]
            if n in lens.layers:
                self.rows[b][(n, p)] = top
                if not lens.exact:
                    self.kl[b][(n, p)] = (0.0, -float(self.ref.negent[r]))

    def _full(self, b: int, p: int) -> bool:
        """Whether prompt b's rows at position p hold the top-k (the position read)."""
        return self.items[b].read in (None, p)

    def _keep(
        self, decoder: Decoder, part: list[Row], out: torch.Tensor, device: torch.device
    ) -> None:
        """Keep the chunk's rows for a comparison (`as_batch`, else at the position read), and
        the other model's rows through this decoder in the same chunk."""
        keys = []
        for layer, r in part:
            b, p = self.where[r]
            keys.append((b, (layer, p)) if self.lens.as_batch or self._full(b, p) else None)
        if all(key is None for key in keys):
            return
        theirs = None if not self.other else decode_rows(decoder, self.other, part, device)
        own, other = kept_rows(keys, out, theirs)
        for (b, key), row in own:
            self.kept[b].logits[key] = row
        for (b, key), row in other:
            self.kept[b].other[key] = row

    def _check(self, part: list[Row], out: torch.Tensor) -> None:
        """The self-check: the last block's rows decoded against the model's own logits."""
        last = [i for i, (layer, _) in enumerate(part) if layer == self.lens.n_layers]
        if not last or self.real is None:
            return
        refs = [part[i][1] for i in last]
        mine, theirs = out[last], self.real[refs].to(out.device)
        diffs = (mine - theirs).abs().amax(-1).tolist()
        agrees = (mine.argmax(-1) == theirs.argmax(-1)).tolist()
        for r, diff, agree in zip(refs, diffs, agrees, strict=True):
            b = self.where[r][0]
            self.diff[b] = max(self.diff[b], diff)
            self.agrees[b] = self.agrees[b] and agree

    def _take(self, part: list[Row], out: torch.Tensor) -> None:
        """Keep a chunk's rows below the last layer, reduced, with their statistics."""
        keep = [i for i, (layer, _) in enumerate(part) if layer != self.lens.n_layers]
        if not keep:
            return
        x = out if len(keep) == len(part) else out[keep]
        where = [self.where[part[i][1]] for i in keep]
        if self.lens.exact:
            tops = self._tops(where, x, None)
        else:
            lx = torch.log_softmax(x, dim=-1)
            kl, entropy = self.ref.kl_entropy([part[i][1] for i in keep], lx)
            tops = self._tops(where, x, lx)
        for j, i in enumerate(keep):
            layer = part[i][0]
            b, p = where[j]
            self.rows[b][(layer, p)] = tops[j]
            if not self.lens.exact:
                self.kl[b][(layer, p)] = (kl[j], entropy[j])

    def _tops(
        self, where: list[tuple[int, int]], x: torch.Tensor, lx: torch.Tensor | None
    ) -> list[Top]:
        """The ranking of each (prompt, position) row: the top-k at its prompt's position read,
        the top-1 elsewhere (in a batch with the target, from `lx`, the rows' log_softmax; one
        prompt's other cells without: `stats.exact_top1`)."""
        k, vocab = self.lens.k, min(self.lens.real_vocab, self.vocab)
        full = [j for j, (b, p) in enumerate(where) if self._full(b, p)]
        nexts = [next_ids(self.items[b].ids, [p])[0] for b, p in where]
        targets = [self.items[b].target for b, _ in where]

        def ranked(at: list[int], k: int) -> list[Top]:
            every = len(at) == len(where)
            rows, after = (x if every else x[at]), [nexts[j] for j in at]
            if lx is None:
                return exact_tops(rows, k, vocab, targets[0], after)
            told = [targets[j] for j in at]
            return tops_from_log_softmax(rows, lx if every else lx[at], k, vocab, told, after)

        everyone = list(range(len(where)))
        if len(full) == len(where) or (k == 1 and lx is not None):
            return ranked(everyone, k)
        cells = lx is None and not self.lens.as_batch  # one prompt's grid: the top-1 alone
        tops = exact_top1(x, vocab) if cells else ranked(everyone, 1)
        for j, top in zip(full, ranked(full, k) if full else [], strict=True):
            tops[j] = top
        return tops

    def result(self, b: int, steps: list[str], full: bool, suspect: str) -> BatchOut:
        """Prompt b's result (`suspect`: the step named where its check fails), its statistics
        and the model's top-1 at each position."""
        lens = self.lens
        ok = self.diff[b] <= self.tol
        start = self.first[b]
        end = start + len(self.items[b].positions)

        def rows_of(t: torch.Tensor) -> torch.Tensor:  # one prompt: its rows as they are
            return t if len(self.items) == 1 else t[start:end]

        kept = None
        if lens.keep:
            residual = {layer: rows_of(rows) for layer, rows in self.residual.items()}
            kept = Kept(self.kept[b].logits, self.kept[b].other, residual)
        result = LensResult(
            num_layers=lens.n_layers,
            vocab_size=self.vocab,
            real_vocab=lens.real_vocab,
            positions=list(self.items[b].positions),
            layers=lens.layers,
            rows=self.rows[b],
            check=Check(self.diff[b], self.tol, self.agrees[b], None if ok else suspect),
            steps=steps,
            full_tail=full,
            output=None if self.real is None else rows_of(self.real),
            kept=kept,
        )
        return BatchOut(result, self.kl[b], self.top1[b])


def _other_rows(items: list[BatchItem]) -> dict[int, torch.Tensor] | None:
    """The other model's residual at every row of the batch, in the batch's order (None unless
    every item has one)."""
    if not items or any(item.other is None for item in items):
        return None
    layers = items[0].other or {}
    return {layer: torch.cat([(item.other or {})[layer] for item in items]) for layer in layers}


def check_decoded(out: torch.Tensor, part: list[Row], position: Callable[[int], int]) -> None:
    """Refuse a decoded row that is not finite (the model's own logits were finite); `position`
    gives the prompt position of a capture row."""
    if bool(out.sum(-1).isfinite().all()):  # a NaN or an infinity makes its row's sum one
        return
    bad = ~out.isfinite().all(-1)  # a sum of finite logits may overflow: look at each
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        layer, r = part[i]
        raise NumericError(
            f"decoding layer {layer} at position {position(r)} through the model's final steps "
            f"gives {not_finite(out[i])} logits, though the model's own logits are finite: the "
            "lens cannot be read there",
            hint="in a 16-bit dtype the lens can overflow: try --dtype float32",
        )
