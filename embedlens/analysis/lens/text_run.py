"""One window of `lens --text` through the model(s): the residual stream captured once, every
layer decoded in chunks of bounded size, and each chunk reduced to per-token figures at once.

Memory holds one window's residual stream (layers x scored tokens x width) and one chunk of
logits (`CHUNK_BYTES`), never the logits of every token: only sums and, for a comparison, one
KL and one Δp per (layer, token) are kept (`WindowSums`). The residual stream and each site's
are reduced by the same loop (`TextRun._sums`). The report is built from the windows' sums and
the run (`text_report`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from embedlens.analysis.lens import options
from embedlens.analysis.lens.blocks import (
    Capture,
    Decoder,
    ModelDecoder,
    capture,
    find_blocks,
    input_device,
    threads_for,
)
from embedlens.analysis.lens.engine import decode_rows, tolerance
from embedlens.analysis.lens.stats import ROW_STATS, Reference, Sums, add_row, row_stats, rowdot
from embedlens.analysis.lens.text_stats import ONE, PAIR, TextTotals, WindowSums
from embedlens.reports.lens_text import LensTextReport, TextSiteLayer, TextSitePairLayer

if TYPE_CHECKING:
    from embedlens.analysis.lens.opening import Opened

CHUNK_BYTES = 64 * 2**20
"""float32 logits decoded and reduced at once (the reduction holds a few such arrays)."""
TOP_K = 256
"""Log-probabilities a logits file keeps per token (`text.LogitsFile`)."""


@dataclass(frozen=True)
class Window:
    """One window: its index, its ids, the positions scored, their next tokens and bytes."""

    index: int
    ids: list[int]
    positions: list[int]
    targets: list[int]
    n_bytes: int


def _lp(logits: Tensor, out: Tensor | None = None) -> Tensor:
    return torch.log_softmax(logits, dim=-1, out=out)


def _top1(logits: Tensor, vocab: int) -> Tensor:
    """Each row's argmax among the `vocab` real tokens (the first of equal maxima, as argmax
    gives it: torch's max along a dimension is half argmax's time on CPU)."""
    return logits[:, :vocab].max(-1).indices


PairRows = tuple[Tensor, Tensor, Tensor]
"""A chunk's [n, len(PAIR)] figures per row, with its per-row KL and Δp."""


class Scratch:
    """[rows, V] buffers kept from one chunk to the next for the per-row reductions. A fresh
    64 MiB array is mapped anew by the allocator and faulted in page by page, which cost as
    much as the log-softmax or exp written into it; written into a kept buffer, the figures are
    the same bits."""

    def __init__(self) -> None:
        self._kept: dict[str, Tensor] = {}

    def __call__(self, name: str, like: Tensor) -> Tensor:
        """A buffer of `like`'s shape, dtype and device (its contents undefined)."""
        buf, n = self._kept.get(name), like.shape[0]
        kind = like.shape[1:], like.dtype, like.device
        if buf is None or buf.shape[0] < n or (buf.shape[1:], buf.dtype, buf.device) != kind:
            buf = self._kept[name] = torch.empty(like.shape, dtype=like.dtype, device=like.device)
        return buf[:n]


def _one_rows(
    logits: Tensor, out: tuple[Tensor, Tensor] | None, t: Tensor,
    vocab: int, scratch: Scratch, name: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """[n, len(ONE)] per row: NLL, NLL², KL(output ‖ lens), entropy, top-1 hit (float64), with
    the rows' log-probabilities, probabilities (`scratch`'s buffers `name`) and argmax; `out`:
    the output's probabilities and Σ p log p at the same rows (None: these rows are the
    output's own, KL 0). KL is Σ p_out log p_out - Σ p_out log p_lens, each a dot per row (as
    `lens --prompts` takes it), so no [n, V] product is kept."""
    lp = _lp(logits, scratch(f"{name}.lp", logits))
    p = torch.exp(lp, out=scratch(f"{name}.p", logits))
    nll = -lp.gather(1, t[:, None])[:, 0]
    negent = rowdot(p, lp, out=scratch("product", lp))
    kl = (
        torch.zeros_like(nll)
        if out is None
        else (out[1] - rowdot(out[0], lp, out=scratch("product", lp))).clamp_min(0)
    )
    top = _top1(logits, vocab)
    top1 = (top == t).float()
    return torch.stack([nll, nll * nll, kl, -negent, top1], 1).double(), lp, p, top


def _kl(la: Tensor, pa: Tensor, lb: Tensor, scratch: Scratch) -> Tensor:
    """Σ pa·(la - lb) per row (float64), the difference and product written into a buffer."""
    diff = torch.sub(la, lb, out=scratch("product", la))
    return diff.mul_(pa).sum(-1).double()


def _pair_columns(nll_a: Tensor, nll_b: Tensor, kl: Tensor, same: Tensor, res: Tensor) -> PairRows:
    """[n, len(PAIR)] per row from the two NLLs, the KL, the argmaxes' agreement and the
    residual KL (float64), with the per-row KL and Δp."""
    dp = torch.exp(-nll_b) - torch.exp(-nll_a)
    dp2 = dp * dp
    cols = [nll_a, nll_a * nll_a, nll_b, nll_b * nll_b, nll_a * nll_b, kl, kl * kl, dp, dp2,
            dp2 * dp2, same, res]  # fmt: skip
    return torch.stack(cols, 1), kl, dp


def _pair_rows(
    ref: tuple[Tensor, Tensor, Tensor, Tensor], b: Tensor,
    r: Tensor | None, t: Tensor, vocab: int, scratch: Scratch,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """`_pair_columns` of a chunk (ref: the reference's logits, log-probabilities,
    probabilities and argmax; b: the evaluated's logits; r: the reference's decoder on the
    evaluated's residual, `b` itself when the two tails are one)."""
    _, la, pa, top_a = ref
    lb = _lp(b, scratch("other.lp", b))
    nll_a = -la.gather(1, t[:, None])[:, 0].double()
    nll_b = -lb.gather(1, t[:, None])[:, 0].double()
    kl = _kl(la, pa, lb, scratch)
    same = (top_a == _top1(b, vocab)).double()
    if r is None:
        res = torch.zeros_like(kl)
    else:
        res = kl if r is b else _kl(la, pa, _lp(r, scratch("other.lp", r)), scratch)
    return _pair_columns(nll_a, nll_b, kl, same, res)


def file_pair_rows(ref: dict[str, np.ndarray], b: Tensor, t: Tensor, vocab: int) -> PairRows:
    """`_pair_rows` with the reference read from a logits file (`ref`: its rows of the window,
    `LogitsFile.window`): its top-k log-probabilities and the rest of its mass lumped (KL over
    the top-k, plus r_ref·ln(r_ref/r_eval) for the mass r outside them: a lower bound of the
    full KL)."""
    logp, ids = torch.from_numpy(ref["logp"]), torch.from_numpy(ref["ids"]).long()
    lb = _lp(b)
    pa = logp.exp()
    lb_k = lb.gather(1, ids)
    ra = (1 - pa.sum(-1)).clamp_min(0).double()
    rb = (1 - lb_k.exp().sum(-1)).clamp_min(1e-30).double()
    tail = torch.where(ra > 0, ra * (ra.clamp_min(1e-300).log() - rb.log()), 0.0)
    kl = ((pa * (logp - lb_k)).sum(-1).double() + tail).clamp_min(0)
    nll_a = -torch.from_numpy(ref["target_logp"]).double()
    nll_b = -lb.gather(1, t[:, None])[:, 0].double()
    same = (torch.from_numpy(ref["top1"]).long() == _top1(b, vocab)).double()
    return _pair_columns(nll_a, nll_b, kl, same, torch.zeros_like(kl))


def kept_logits(out: Tensor, t: Tensor, vocab: int) -> dict[str, np.ndarray]:
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


Part = tuple[list[tuple[int, int]], bool]
"""A chunk of (layer, position) rows, and whether they are the model's output (its logits,
never decoded)."""


Asked = tuple[object, bool, tuple[str, ...]]
"""Where the logits are saved (None: not), whether B's residual is read by A, and the sites
inside the blocks read beside the residual stream (`--site`)."""


class TextRun:
    """Windows through a model (and another, or a logits file, to compare with)."""

    def __init__(
        self, opened: Opened, items: Any, other: Opened | None, lens_dir: Any, more: Asked
    ) -> None:
        """The window runner for A (its tuned lens beside the logit lens), and B (through the
        same tuned lens: A's, checked against B's blocks alone)."""
        save_logits, self.residual, self.sites = more
        self.other = None if other is None else (other.model, _lenses(other, lens_dir)["one"])
        """B and its lens (with --tuned, A's tuned lens: its fingerprints are A's)."""
        self.model, self.lenses = opened.model, _lenses(opened, lens_dir, own=True)
        self.n_layers = len(find_blocks(opened.model).modules)
        self.layers = sorted(set(options.resolve_layers(items, self.n_layers)) | {self.n_layers})
        get: Any = getattr(opened.model, "get_output_embeddings", None)
        weight = getattr(get() if callable(get) else None, "weight", None)
        rows = len(opened.tokenizer) if weight is None else int(weight.shape[0])
        self.vocab = min(len(opened.tokenizer), rows)
        self.keep_logits = save_logits is not None
        self.tuned = _kind(lens_dir)
        """'tuned' or 'jacobian': a learned lens, the logit lens beside it (None: none)."""
        self.device = input_device(opened.model)
        self.scratch = Scratch()
        self.check: tuple[float, float] | None = None
        """(max |decoded last layer - logits|, tolerance), from the first window run."""
        self.same_tail = other is not None and same_tail(opened.model, other.model)
        """B's tail is A's, bit for bit: A's decoder on B's residual is B's own lens."""

    def _capture(self, model: nn.Module, w: Window) -> Capture:
        blocks = find_blocks(model)
        return capture(model, blocks, [w.ids], [w.positions], self.layers, None, masked=False)

    def run(self, w: Window, ref: dict[str, np.ndarray] | None = None) -> WindowSums:
        """One window's sums (`ref`: the rows of a logits file to compare the output with)."""
        model = self.model
        with torch.inference_mode(), threads_for(model, len(w.ids)):
            cap = self._capture(model, w)
            theirs = None if self.other is None else self._capture(self.other[0], w)
            assert cap.logits is not None
            real = cap.logits
            t = torch.tensor(w.targets, dtype=torch.long, device=real.device)
            if self.check is None:
                self._self_check(cap)
            out = Reference(real)
            decoded = [(x, j) for x in self.layers if x != self.n_layers for j in range(len(t))]
            output = [(self.n_layers, j) for j in range(len(t))]
            parts = self._parts(decoded, False, real) + self._parts(output, True, real)
            sums = self._sums(w, parts, (cap, theirs), out, t)
            if ref is not None:
                rows, kl, dp = file_pair_rows(ref, real, t, self.vocab)
                sums.sums["pair"] = rows.sum(0, keepdim=True).cpu().numpy()
                sums.values = {
                    k: v.float().cpu().numpy()[None] for k, v in (("kl", kl), ("dp", dp))
                }
            if self.keep_logits:
                sums.extra = kept_logits(real, t, self.vocab)
            if self.sites != ("resid",):
                self._site_sums(sums, w, out, t)
            return sums

    @staticmethod
    def _parts(rows: list[tuple[int, int]], last: bool, like: Tensor) -> list[Part]:
        """`rows` in chunks of at most `CHUNK_BYTES` of float32 logits (`like`'s width)."""
        chunk = max(1, CHUNK_BYTES // (4 * like.shape[1]))
        return [(rows[s : s + chunk], last) for s in range(0, len(rows), chunk)]

    def _site_sums(self, sums: WindowSums, w: Window, out: Reference, t: Tensor) -> None:
        """Each site's sums, its rows decoded and reduced as the residual stream's are, from
        the window's blocks taken apart (their sums checked: `sites`); with --against, B's
        blocks taken apart on the same window and its site rows compared with A's as the
        residual stream's are (through B's own decoder); layer 0 has none."""
        from embedlens.analysis.lens.site_report import sums as block_sums
        from embedlens.analysis.lens.sites import PIECE, stream, take_apart

        mid = "resid_mid" in self.sites
        pieces = take_apart(self.model, w.ids, w.positions, mid)
        sums.blocks = block_sums(pieces)
        theirs = None
        if self.other is not None:
            theirs = take_apart(self.other[0], w.ids, w.positions, mid)
        layers = [x for x in self.layers if x >= 1]
        parts = self._parts([(x, j) for x in layers for j in range(len(t))], False, out.prob)
        for site in (s for s in self.sites if s != "resid"):
            a = Capture({x: stream((PIECE[site], x), pieces) for x in layers})
            b = None
            if theirs is not None:
                b = Capture({x: stream((PIECE[site], x), theirs) for x in layers})
            sums.sites[site] = self._sums(w, parts, (a, b), out, t, site=True)

    def _sums(
        self,
        w: Window,
        parts: list[Part],
        caps: tuple[Capture, Capture | None],
        out: Reference,
        t: Tensor,
        site: bool = False,
    ) -> WindowSums:
        """A window's sums over the chunks `parts` of its rows (`caps`: A's capture and B's);
        the logit lens beside a tuned one, and A's decoder on B's residual, on the residual
        stream alone (not a `site`'s)."""
        index = {layer: i for i, layer in enumerate(self.layers)}
        lenses = {"one": self.lenses["one"]} if site else self.lenses
        n = len(self.layers)
        acc = {key: torch.zeros(n, len(ONE), dtype=torch.float64) for key in lenses}
        values: dict[str, Tensor] = {}
        if caps[1] is not None:
            acc["pair"] = torch.zeros(n, len(PAIR), dtype=torch.float64)
            values = {"kl": torch.zeros(n, len(t)), "dp": torch.zeros(n, len(t))}
        kept: dict[str, list[Sums]] = {}
        for part in parts:
            at = torch.tensor([index[layer] for layer, _ in part[0]])
            js = torch.tensor([j for _, j in part[0]])
            on = js.to(t.device)  # the logits' device: the targets' and the output's rows'
            tj = t[on]
            oj = None if part[1] else (out.prob[on], out.negent[on])
            mine: tuple[Tensor, Tensor, Tensor, Tensor] | None = None
            for key, decoder in lenses.items():
                logits = self._rows(decoder, caps[0], part)
                rows, lp, p, top = _one_rows(logits, oj, tj, self.vocab, self.scratch, key)
                acc[key].index_add_(0, at, rows.cpu())
                self._row_sums(kept, key, logits, tj, at)
                mine = mine or (logits, lp, p, top)
            if caps[1] is not None and mine is not None:
                b, r = self._theirs(caps[1], part, mine[0].device, residual=not site)
                rows, kl, dp = _pair_rows(mine, b, r, tj, self.vocab, self.scratch)
                acc["pair"].index_add_(0, at, rows.cpu())
                self._row_sums(kept, "against", b, tj, at)
                values["kl"][at, js], values["dp"][at, js] = kl.float().cpu(), dp.float().cpu()
        sums = {key: a.numpy() for key, a in acc.items()}
        found = {key: v.numpy() for key, v in values.items()}
        return WindowSums(w.index, len(t), w.n_bytes, sums, found, rows=kept)

    def _rows(self, decoder: Decoder, cap: Capture, part: Part) -> Tensor:
        """A chunk's rows: the model's own logits at its output, else decoded."""
        rows, last = part
        if last:
            assert cap.logits is not None
            return cap.logits[torch.tensor([j for _, j in rows], device=cap.logits.device)]
        return decode_rows(decoder, cap.residual, rows, self.device)

    def _theirs(
        self, cap: Capture, part: Part, device: torch.device, residual: bool
    ) -> tuple[Tensor, Tensor | None]:
        """B's rows of a chunk (its logits at the output, else its own lens) and, with
        `residual`, this model's decoder on B's residual (B's rows themselves where the two
        tails are one: the same computation on the same rows, the same bits)."""
        assert self.other is not None
        b = self._rows(self.other[1], cap, part).to(device)
        if not (residual and self.residual):
            return b, None
        if self.same_tail and not part[1]:
            return b, b
        return b, self._rows(self.lenses["one"], cap, (part[0], False)).to(device)

    def _self_check(self, cap: Capture) -> None:
        """Decoding the last block's output at the first rows must give the model's logits."""
        assert cap.logits is not None
        n = min(8, cap.logits.shape[0])
        rows = [(self.n_layers, j) for j in range(n)]
        mine = decode_rows(self.lenses["one"], cap.residual, rows, self.device)
        real = cap.logits[:n].to(mine.device)
        tol = tolerance(next(self.model.parameters()).dtype, real)
        self.check = float((mine - real).abs().max()), tol

    def _row_sums(
        self, rows: dict[str, list[Sums]], key: str, logits: Tensor, t: Tensor, at: Tensor
    ) -> None:
        """Each row's `ROW_STATS` (`t`: the observed next tokens) added to the sums `key` of
        its layer (`at`: the layers' indices)."""
        if not ROW_STATS:
            return
        each = rows.setdefault(key, [Sums() for _ in self.layers])
        values = row_stats(logits, self.vocab, [None] * len(t), t.tolist())
        for i, row in zip(at.tolist(), values, strict=True):
            add_row(each[i], row)


def _kind(lens_dir: object) -> str | None:
    """'tuned' or 'jacobian': the kind of learned lens read (None without one)."""
    from embedlens.analysis.lens.jacobian import JacobianFile

    if lens_dir is None:
        return None
    return "jacobian" if isinstance(lens_dir, JacobianFile) else "tuned"


def _lenses(o: Opened, lens_dir: Any, own: bool = False) -> dict[str, Decoder]:
    """A model's lens ('one'): its logit lens, or its tuned lens (`lens_dir`) with, when it is
    A's (`own`: the lens's fingerprints checked), the logit lens beside it ('logit')."""
    dummy = o.tokenizer.eos_token_id or 0
    plain = ModelDecoder(o.model, find_blocks(o.model), dummy_id=int(dummy))
    from embedlens.analysis.lens.decoders import tuned_through

    through = tuned_through(lens_dir, o.model, o.tokenizer, fingerprints=own)
    if through is None:
        return {"one": plain}
    wrap = through.wrap
    return {"one": wrap(plain), "logit": plain} if own else {"one": wrap(plain)}


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

    def outside(m: nn.Module) -> list[tuple[str, Tensor]]:
        blocks = find_blocks(m).modules
        inside = {id(t) for block in blocks for t in (*block.parameters(), *block.buffers())}
        tensors = [*m.named_parameters(), *m.named_buffers()]
        return [(name, t) for name, t in tensors if id(t) not in inside]

    mine, theirs = outside(a), outside(b)
    return [n for n, _ in mine] == [n for n, _ in theirs] and all(
        x.dtype == y.dtype and x.shape == y.shape and x.device == y.device and torch.equal(x, y)
        for (_, x), (_, y) in zip(mine, theirs, strict=True)
    )


def text_report(
    opened: Opened,
    run: TextRun,
    done: list[WindowSums],
    head: dict[str, Any],
    other: Opened | None,
    reference: str | None,
) -> LensTextReport:
    """The report of a run (`done`: every window's sums; `head`: the text's fields): the lens's
    rows, and with B or a logits file (`reference`: its model) the comparison; with --site, a
    row per (layer, site asked) in block order (with B, B's sites against A's) and the blocks'
    check over every window."""
    from embedlens.analysis.lens.report import dtype_name

    totals = TextTotals(run.layers, done)
    ppl, ppl_err = totals.perplexity()
    diff, tol = run.check or (0.0, 0.0)
    evaluated = None
    if reference is not None:
        totals.pair_layers = [run.n_layers]
        evaluated = opened.name
    elif other is not None:
        reference, evaluated = opened.name, other.name
    residual = other is not None and run.residual
    layers, pair = totals.one(), None if reference is None else totals.pair(residual)
    sites, blocks = run.sites, None
    if sites != ("resid",):
        from embedlens.analysis.lens.site_report import worse

        layers = totals.site_rows(sites, TextSiteLayer, lambda s: totals.one(site=s))
        if other is not None:
            pair = totals.site_rows(
                sites, TextSitePairLayer, lambda s: totals.pair(residual and s == "resid", s)
            )
        for w in totals.windows:
            assert w.blocks is not None
            blocks = worse(blocks, w.blocks)
    return LensTextReport(
        model=opened.name,
        **head,
        n_scored=totals.n,
        n_bytes=totals.n_bytes,
        num_layers=run.n_layers,
        dtype=dtype_name(opened.model),
        perplexity=ppl,
        perplexity_err=ppl_err,
        layers=layers,
        lens=run.tuned or "logit",
        logit_layers=totals.one("logit") if run.tuned else None,
        reference=reference,
        evaluated=evaluated,
        pair=pair,
        pair_output=None if reference is None else totals.pair_output(),
        check_ok=not diff > tol,
        max_abs_logit_diff=diff,
        notes=[*opened.before, *opened.after],
        sites=None if sites == ("resid",) else list(sites),
        block_sums=blocks,
    )
