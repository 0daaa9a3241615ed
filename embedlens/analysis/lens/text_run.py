"""One window of `lens --text` through the model(s): the residual stream captured once, every
layer decoded in chunks of bounded size, and each chunk reduced to per-token figures at once.

Memory holds one window's residual stream (layers x scored tokens x width) and one chunk of
logits (`CHUNK_BYTES`), never the logits of every token: only sums and, for a comparison, one
KL and one Δp per (layer, token) are kept (`text_stats.WindowSums`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from embedlens.analysis.lens.blocks import (
    Capture,
    Decoder,
    capture,
    find_blocks,
    input_device,
    threads_for,
)
from embedlens.analysis.lens.engine import decode_rows, tolerance
from embedlens.analysis.lens.stats import ROW_STATS, Sums, add_row, row_stats, rowdot
from embedlens.analysis.lens.text_stats import ONE, PAIR, WindowSums

if TYPE_CHECKING:
    from embedlens.analysis.lens.sites import Pieces

CHUNK_BYTES = 64 * 2**20
"""float32 logits decoded and reduced at once (the reduction holds a few such arrays)."""
TOP_K = 256
"""Log-probabilities a logits file keeps per token (`logits_file`)."""


@dataclass
class Side:
    """A model with its decoder(s): the lens's (tuned or logit) and, with --tuned, the logit
    lens's beside it."""

    model: nn.Module
    decoder: Decoder
    logit: Decoder | None = None


@dataclass(frozen=True)
class Window:
    """One window: its index, its ids, the positions scored, their next tokens and bytes."""

    index: int
    ids: list[int]
    positions: list[int]
    targets: list[int]
    n_bytes: int


@dataclass
class Reference:
    """A logits file's rows for one window (the reference side of a comparison)."""

    ids: torch.Tensor
    """[P, k] token ids, the top-k of the reference's output."""
    logp: torch.Tensor
    """[P, k] their log-probabilities."""
    target_logp: torch.Tensor
    """[P] the true next token's log-probability."""
    top1: torch.Tensor
    """[P] the reference's argmax."""


def _lp(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    if out is None:
        return torch.log_softmax(logits, dim=-1)
    return torch.log_softmax(logits, dim=-1, out=out)


def _top1(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Each row's argmax among the `vocab` real tokens (the first of equal maxima, as argmax
    gives it: torch's max along a dimension is half argmax's time on CPU)."""
    return logits[:, :vocab].max(-1).indices


class Scratch:
    """[rows, V] buffers kept from one chunk to the next for the per-row reductions. A fresh
    64 MiB array is mapped anew by the allocator and faulted in page by page, which cost as
    much as the log-softmax or exp written into it; written into a kept buffer, the figures are
    the same bits."""

    def __init__(self) -> None:
        self._kept: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A buffer of `like`'s shape, dtype and device (its contents undefined)."""
        buf = self._kept.get(name)
        n = like.shape[0]
        if (
            buf is None
            or buf.shape[0] < n
            or buf.shape[1:] != like.shape[1:]
            or buf.dtype != like.dtype
            or buf.device != like.device
        ):
            buf = torch.empty(like.shape, dtype=like.dtype, device=like.device)
            self._kept[name] = buf
        return buf[:n]


def _log_probs(
    logits: torch.Tensor, scratch: Scratch, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' log-probabilities and probabilities, in `scratch`'s buffers `name`.lp/.p."""
    lp = _lp(logits, scratch(f"{name}.lp", logits))
    return lp, torch.exp(lp, out=scratch(f"{name}.p", logits))


def _one_rows(
    logits: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None, t: torch.Tensor,
    vocab: int, scratch: Scratch, lp: torch.Tensor, p: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """[n, len(ONE)] per row: NLL, NLL², KL(output ‖ lens), entropy, top-1 hit (float64), and
    the rows' argmax; `out`: the output's probabilities and Σ p log p at the same rows (None:
    these rows are the output's own, KL 0). KL is Σ p_out log p_out - Σ p_out log p_lens, each
    a dot per row (as `lens --prompts` takes it), so no [n, V] product is kept. `lp`, `p`: the
    rows' log-probabilities and probabilities (`_log_probs`)."""
    nll = -lp.gather(1, t[:, None])[:, 0]
    negent = rowdot(p, lp, out=scratch("product", lp))
    kl = (
        torch.zeros_like(nll)
        if out is None
        else (out[1] - rowdot(out[0], lp, out=scratch("product", lp))).clamp_min(0)
    )
    top = _top1(logits, vocab)
    top1 = (top == t).float()
    return torch.stack([nll, nll * nll, kl, -negent, top1], 1).double(), top


def _kl(la: torch.Tensor, pa: torch.Tensor, lb: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    """Σ pa·(la - lb) per row (float64), the difference and product written into a buffer."""
    diff = torch.sub(la, lb, out=scratch("product", la))
    return diff.mul_(pa).sum(-1).double()


def _pair_rows(
    ref: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], b: torch.Tensor,
    r: torch.Tensor | None, t: torch.Tensor, vocab: int, scratch: Scratch,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """[n, len(PAIR)] per row (ref: the reference's logits, log-probabilities, probabilities and
    argmax; b: the evaluated's logits; r: the reference's decoder on the evaluated's residual,
    `b` itself when the two tails are one), with the per-row KL and Δp."""
    _, la, pa, top_a = ref
    lb = _lp(b, scratch("other.lp", b))
    nll_a = -la.gather(1, t[:, None])[:, 0].double()
    nll_b = -lb.gather(1, t[:, None])[:, 0].double()
    kl = _kl(la, pa, lb, scratch)
    dp = torch.exp(-nll_b) - torch.exp(-nll_a)
    same = (top_a == _top1(b, vocab)).double()
    if r is None:
        res = torch.zeros_like(kl)
    else:
        res = kl if r is b else _kl(la, pa, _lp(r, scratch("other.lp", r)), scratch)
    dp2 = dp * dp
    cols = [nll_a, nll_a * nll_a, nll_b, nll_b * nll_b, nll_a * nll_b, kl, kl * kl, dp, dp2,
            dp2 * dp2, same, res]  # fmt: skip
    return torch.stack(cols, 1), kl, dp


def file_pair_rows(
    ref: Reference, b: torch.Tensor, t: torch.Tensor, vocab: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_pair_rows` with the reference read from a logits file: its top-k log-probabilities and
    the rest of its mass lumped (KL over the top-k, plus r_ref·ln(r_ref/r_eval) for the mass r
    outside them: a lower bound of the full KL)."""
    lb = _lp(b)
    pa = ref.logp.exp()
    lb_k = lb.gather(1, ref.ids)
    ra = (1 - pa.sum(-1)).clamp_min(0).double()
    rb = (1 - lb_k.exp().sum(-1)).clamp_min(1e-30).double()
    tail = torch.where(ra > 0, ra * (ra.clamp_min(1e-300).log() - rb.log()), 0.0)
    kl = ((pa * (ref.logp - lb_k)).sum(-1).double() + tail).clamp_min(0)
    nll_a = -ref.target_logp.double()
    nll_b = -lb.gather(1, t[:, None])[:, 0].double()
    dp = torch.exp(-nll_b) - torch.exp(-nll_a)
    same = (ref.top1 == _top1(b, vocab)).double()
    dp2 = dp * dp
    cols = [nll_a, nll_a * nll_a, nll_b, nll_b * nll_b, nll_a * nll_b, kl, kl * kl, dp, dp2,
            dp2 * dp2, same, torch.zeros_like(kl)]  # fmt: skip
    return torch.stack(cols, 1), kl, dp


def kept_logits(out: torch.Tensor, t: torch.Tensor, vocab: int) -> dict[str, np.ndarray]:
    """What a logits file keeps of the output's rows: the top-k ids (among the `vocab` real
    tokens) and their log-probabilities (over every row of the output, as its softmax runs),
    the true next token's log-probability and the argmax."""
    lp = _lp(out)
    logp, ids = lp[:, :vocab].topk(min(TOP_K, vocab), dim=-1)
    return {
        "ids": ids.int().cpu().numpy(),
        "logp": logp.cpu().numpy(),
        "target_logp": lp.gather(1, t[:, None])[:, 0].cpu().numpy(),
        "top1": _top1(out, vocab).int().cpu().numpy(),
    }


class TextRun:
    """Windows through a model (and another, or a logits file, to compare with)."""

    def __init__(
        self,
        main: Side,
        layers: list[int],
        vocab: int,
        other: Side | None = None,
        *,
        keep_logits: bool = False,
        residual: bool = True,
        sites: tuple[str, ...] = ("resid",),
    ) -> None:
        self.main, self.other, self.layers, self.vocab = main, other, layers, vocab
        self.sites = sites
        """The sites inside the blocks read beside the residual stream (`--site`)."""
        self.n_layers = len(find_blocks(main.model).modules)
        self.keep_logits = keep_logits
        self.residual = residual
        self.scratch = Scratch()
        self.check: tuple[float, float] | None = None
        """(max |decoded last layer - logits|, tolerance), from the first window run."""
        self.same_tail = other is not None and same_tail(main.model, other.model)
        """B's tail is A's, bit for bit: A's decoder on B's residual is B's own lens."""

    def _capture(self, model: nn.Module, w: Window) -> Capture:
        blocks = find_blocks(model)
        wanted = sorted(set(self.layers) | {self.n_layers})
        return capture(model, blocks, [w.ids], [w.positions], wanted, None, masked=False)

    def run(self, w: Window, ref: Reference | None = None) -> WindowSums:
        """One window's sums (`ref`: the rows of a logits file to compare the output with)."""
        model = self.main.model
        device = input_device(model)
        with torch.inference_mode(), threads_for(model, len(w.ids)):
            cap = self._capture(model, w)
            theirs = None if self.other is None else self._capture(self.other.model, w)
            assert cap.logits is not None
            real = cap.logits
            t = torch.tensor(w.targets, dtype=torch.long, device=real.device)
            if self.check is None:
                self._self_check(cap, device)
            sums = self._reduce(w, cap, theirs, real, t, ref, device)
            if self.sites != ("resid",):
                self._site_sums(sums, w, real, t, device)
            return sums

    def _site_sums(
        self, sums: WindowSums, w: Window, real: torch.Tensor, t: torch.Tensor, device: torch.device
    ) -> None:
        """Each site's sums, its rows decoded and reduced as the residual stream's are, from
        the window's blocks taken apart (their sums checked: `sites`); with --against, B's
        blocks taken apart on the same window and its site rows compared with A's as the
        residual stream's are (through B's own decoder); layer 0 has none."""
        from embedlens.analysis.lens.site_report import sums as block_sums
        from embedlens.analysis.lens.sites import take_apart

        mid = "resid_mid" in self.sites
        pieces = take_apart(self.main.model, w.ids, w.positions, mid)
        sums.blocks = block_sums(pieces)
        theirs = None
        if self.other is not None:
            theirs = take_apart(self.other.model, w.ids, w.positions, mid)
        out_lp = _lp(real)
        out = out_lp.exp(), rowdot(out_lp.exp(), out_lp)
        for site in (s for s in self.sites if s != "resid"):
            sums.sites[site] = self._site(site, (pieces, theirs), w, out, t, device)

    def _site(
        self, site: str, pieces: tuple[Pieces, Pieces | None], w: Window,
        out: tuple[torch.Tensor, torch.Tensor], t: torch.Tensor, device: torch.device,
    ) -> WindowSums:  # fmt: skip
        """One site's sums over a window (`pieces`: A's blocks taken apart, and B's)."""
        from embedlens.analysis.lens.sites import PIECE, stream

        n_pos = out[0].shape[0]
        rows = [(x, j) for x in self.layers if x >= 1 for j in range(n_pos)]
        streams = [None if p is None else {x: stream((PIECE[site], x), p) for x, _ in rows}
                   for p in pieces]  # fmt: skip
        one = torch.zeros(len(self.layers), len(ONE), dtype=torch.float64)
        pair = torch.zeros(len(self.layers), len(PAIR), dtype=torch.float64)
        kl_v, dp_v = torch.zeros(len(self.layers), n_pos), torch.zeros(len(self.layers), n_pos)
        kept: dict[str, list[Sums]] = {}
        chunk = max(1, CHUNK_BYTES // (4 * out[0].shape[1]))
        for s in range(0, len(rows), chunk):
            part = rows[s : s + chunk]
            js = torch.tensor([j for _, j in part], device=out[0].device)
            at = torch.tensor([self.layers.index(x) for x, _ in part])
            mine = decode_rows(self.main.decoder, streams[0], part, device)  # type: ignore[arg-type]
            lp, p = _log_probs(mine, self.scratch, "main")
            oj = out[0][js], out[1][js]
            got, top = _one_rows(mine, oj, t[js], self.vocab, self.scratch, lp, p)
            one.index_add_(0, at, got.cpu())
            self._row_sums(kept, "one", mine, t[js], at)
            if self.other is not None and streams[1] is not None:
                b = decode_rows(self.other.decoder, streams[1], part, device).to(mine.device)
                a = (mine, lp, p, top)
                got, kl, dp = _pair_rows(a, b, None, t[js], self.vocab, self.scratch)
                pair.index_add_(0, at, got.cpu())
                kl_v[at, js.cpu()], dp_v[at, js.cpu()] = kl.float().cpu(), dp.float().cpu()
                self._row_sums(kept, "against", b, t[js], at)
        done = WindowSums(w.index, n_pos, w.n_bytes, one.numpy(), rows=kept)
        if self.other is not None:
            done.pair, done.kl_values, done.dp_values = pair.numpy(), kl_v.numpy(), dp_v.numpy()
        return done

    def _self_check(self, cap: Capture, device: torch.device) -> None:
        """Decoding the last block's output at the first rows must give the model's logits."""
        assert cap.logits is not None
        n = min(8, cap.logits.shape[0])
        rows = [(self.n_layers, j) for j in range(n)]
        mine = decode_rows(self.main.decoder, cap.residual, rows, device)
        real = cap.logits[:n].to(mine.device)
        tol = tolerance(next(self.main.model.parameters()).dtype, real)
        self.check = float((mine - real).abs().max()), tol

    def _reduce(
        self,
        w: Window,
        cap: Capture,
        theirs: Capture | None,
        real: torch.Tensor,
        t: torch.Tensor,
        ref: Reference | None,
        device: torch.device,
    ) -> WindowSums:
        n_pos, vocab = real.shape
        out_lp = _lp(real)
        out_p = out_lp.exp()
        out_negent = rowdot(out_p, out_lp)
        index = {layer: i for i, layer in enumerate(self.layers)}
        one = torch.zeros(len(self.layers), len(ONE), dtype=torch.float64)
        logit = None if self.main.logit is None else torch.zeros_like(one)
        pair = None if theirs is None else one.new_zeros(len(self.layers), len(PAIR))
        kl_v = None if theirs is None else torch.zeros(len(self.layers), n_pos)
        dp_v = None if theirs is None else torch.zeros(len(self.layers), n_pos)
        chunk = max(1, CHUNK_BYTES // (4 * vocab))
        kept: dict[str, list[Sums]] = {}
        decoded = [(x, j) for x in self.layers if x != self.n_layers for j in range(n_pos)]
        parts = [(decoded[s : s + chunk], False) for s in range(0, len(decoded), chunk)]
        if self.n_layers in index:  # the model's own output: its logits, never decoded
            out = [(self.n_layers, j) for j in range(n_pos)]
            parts += [(out[s : s + chunk], True) for s in range(0, n_pos, chunk)]
        for part, last in parts:
            at = torch.tensor([index[layer] for layer, _ in part])
            js = torch.tensor([j for _, j in part])
            tj = t[js.to(t.device)]
            oj = None if last else (out_p[js.to(out_p.device)], out_negent[js.to(out_p.device)])
            if last:
                mine = real[js.to(real.device)]
            else:
                mine = self._decode(self.main.decoder, cap.residual, part, device)
            lp, p = _log_probs(mine, self.scratch, "main")
            rows, top = _one_rows(mine, oj, tj, self.vocab, self.scratch, lp, p)
            one.index_add_(0, at, rows.cpu())
            self._row_sums(kept, "one", mine, tj, at)
            if logit is not None:
                plain = mine if last else self._decode(self.main.logit, cap.residual, part, device)  # type: ignore[arg-type]
                plp, pp = _log_probs(plain, self.scratch, "logit")
                logit.index_add_(
                    0, at, _one_rows(plain, oj, tj, self.vocab, self.scratch, plp, pp)[0].cpu()
                )
                self._row_sums(kept, "logit", plain, tj, at)
            if theirs is not None and pair is not None and kl_v is not None and dp_v is not None:
                rows, kl, dp, b = self._pair(theirs, part, last, js, (mine, lp, p, top), tj, device)
                pair.index_add_(0, at, rows.cpu())
                self._row_sums(kept, "against", b, tj, at)
                kl_v[at, js], dp_v[at, js] = kl.float().cpu(), dp.float().cpu()
        sums = WindowSums(w.index, n_pos, w.n_bytes, one.numpy(),
                          None if logit is None else logit.numpy(), rows=kept)  # fmt: skip
        if pair is not None and kl_v is not None and dp_v is not None:
            sums.pair, sums.kl_values, sums.dp_values = pair.numpy(), kl_v.numpy(), dp_v.numpy()
        return self._with_file(sums, ref, real, t)

    def _with_file(
        self, sums: WindowSums, ref: Reference | None, real: torch.Tensor, t: torch.Tensor
    ) -> WindowSums:
        """The window's sums with a logits file's comparison and the logits kept to save."""
        if ref is not None:
            rows, kl, dp = file_pair_rows(ref, real, t, self.vocab)
            sums.pair = rows.sum(0, keepdim=True).cpu().numpy()
            sums.kl_values = kl.float().cpu().numpy()[None]
            sums.dp_values = dp.float().cpu().numpy()[None]
        if self.keep_logits:
            sums.extra = kept_logits(real, t, self.vocab)
        return sums

    def _pair(
        self,
        theirs: Capture,
        part: list[tuple[int, int]],
        last: bool,
        js: torch.Tensor,
        a: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        tj: torch.Tensor,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A chunk's rows of the other model (its logits at the output, else its own lens) and,
        with `residual`, this model's decoder on its residual: the comparison's per-row figures,
        and the other model's rows."""
        assert self.other is not None and theirs.logits is not None
        if last:
            b = theirs.logits[js.to(theirs.logits.device)]
        else:
            b = self._decode(self.other.decoder, theirs.residual, part, device)
        mine = a[0]
        b = b.to(mine.device)
        r = None
        if self.residual and self.same_tail and not last:
            r = b  # the same computation on the same rows: the same bits
        elif self.residual:
            r = self._decode(self.main.decoder, theirs.residual, part, device).to(mine.device)
        return (*_pair_rows(a, b, r, tj, self.vocab, self.scratch), b)

    def _row_sums(
        self, rows: dict[str, list[Sums]], key: str, logits: torch.Tensor, t: torch.Tensor,
        at: torch.Tensor,
    ) -> None:  # fmt: skip
        """Each row's `ROW_STATS` (`t`: the observed next tokens) added to the sums `key` of
        its layer (`at`: the layers' indices)."""
        if not ROW_STATS:
            return
        each = rows.setdefault(key, [Sums() for _ in self.layers])
        values = row_stats(logits, self.vocab, [None] * len(t), t.tolist())
        for i, row in zip(at.tolist(), values, strict=True):
            add_row(each[i], row)

    @staticmethod
    def _decode(
        decoder: Decoder, residual: dict[int, torch.Tensor], part: list[tuple[int, int]],
        device: torch.device,
    ) -> torch.Tensor:  # fmt: skip
        return decode_rows(decoder, residual, part, device)


def same_tail(a: nn.Module, b: nn.Module) -> bool:
    """Whether two models decode a residual row alike, bit for bit: the same class and config
    (names aside, and the GGUF file type a model was read from: its weights are floats), and
    every weight outside the blocks (embeddings, final norm, head) equal."""
    if type(a) is not type(b):
        return False

    def config(m: nn.Module) -> dict[str, object]:
        c = getattr(m, "config", None)
        d = c.to_dict() if c is not None and hasattr(c, "to_dict") else {}
        kept = {k: v for k, v in d.items() if not k.startswith("_") and k != "name_or_path"}
        q = kept.get("quantization_config")
        if isinstance(q, dict) and q.get("quant_method") == "gguf":  # read into float weights
            del kept["quantization_config"]
        return kept

    if not config(a) or config(a) != config(b):
        return False

    def outside(m: nn.Module) -> list[tuple[str, torch.Tensor]]:
        blocks = find_blocks(m).modules
        inside = {id(t) for block in blocks for t in (*block.parameters(), *block.buffers())}
        tensors = [*m.named_parameters(), *m.named_buffers()]
        return [(name, t) for name, t in tensors if id(t) not in inside]

    mine, theirs = outside(a), outside(b)
    return [n for n, _ in mine] == [n for n, _ in theirs] and all(
        x.dtype == y.dtype and x.shape == y.shape and x.device == y.device and torch.equal(x, y)
        for (_, x), (_, y) in zip(mine, theirs, strict=True)
    )
