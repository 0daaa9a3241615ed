"""What the windows of `lens --text` leave: their sums, read out with llama-perplexity's
definitions (tools/perplexity's `kl_divergence`: docs/text.md gives each) into the report's rows
(`TextTotals`; `text_run.text_report` builds the report), and the output's rows a logits file
keeps.

Each window leaves float64 sums per layer (`WindowSums`) and, for a comparison, the per-token KL
and Δp values (float32, tokens x layers: llama.cpp keeps the same to sort them). Windows are
combined in window order whichever process ran them, so a split run gives the same sums.

`--save-logits` / `--against-logits`: the output layer of a run kept compactly in a NumPy .npz
file (`LogitsFile`): per scored token, the top `text_run.TOP_K` token ids of the output and their
log-probabilities (over the whole softmax), the true next token's log-probability and the argmax;
with the run's token ids, window rule and vocabulary size, so that a later run on another model
(a quantisation of it) reads the same tokens and compares its output with this one. That is
O(tokens x k), not O(tokens x vocabulary) as llama.cpp's 16-bit --kl-divergence-base file.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from embedlens.analysis.lens.stats import ROW_STATS, Sums
from embedlens.errors import UsageError
from embedlens.reports.lens import BlockSums
from embedlens.reports.lens_text import TextLayer, TextPairLayer, TextPairOutput

ONE = ("nll", "nll2", "kl", "entropy", "top1")
"""Sums per layer of one model: NLL, NLL², KL(output ‖ lens), entropy, top-1 hits."""
PAIR = tuple("nll_a nll_a2 nll_b nll_b2 nll_ab kl kl2 dp dp2 dp4 same res_kl".split())
"""Sums per layer of a comparison (a: the reference, b: the evaluated side)."""
FORMAT = "embedlens-logits/1"
KEYS = ("ids", "logp", "target_logp", "top1")
"""The arrays a logits file keeps per scored token (`text_run.kept_logits`)."""

KL_AT = (("max", 1.0), ("99.9", 0.999), ("99", 0.99), ("95", 0.95), ("90", 0.9),
         ("median", 0.5), ("10", 0.1), ("5", 0.05), ("1", 0.01), ("0.1", 0.001),
         ("min", 0.0))  # fmt: skip
DP_AT = (("max", 1.0), ("99.9", 0.999), ("99", 0.99), ("95", 0.95), ("90", 0.9), ("75", 0.75),
         ("median", 0.5), ("25", 0.25), ("10", 0.1), ("5", 0.05), ("1", 0.01), ("0.1", 0.001),
         ("min", 0.0))  # fmt: skip


@dataclass
class WindowSums:
    """What one window leaves: per layer float64 `sums` (rows in `layers` order): 'one' [layers,
    len(ONE)] (the lens), 'logit' (the logit lens beside a tuned one), 'pair' [layers,
    len(PAIR)] (a comparison); and a comparison's per-token `values` 'kl' and 'dp' [layers,
    tokens] (float32)."""

    index: int
    n: int
    n_bytes: int
    sums: dict[str, np.ndarray]
    values: dict[str, np.ndarray] = field(default_factory=dict)
    rows: dict[str, list[Sums]] = field(default_factory=dict)
    """Each layer's `stats.ROW_STATS` sums: 'one', 'logit', 'against' (the evaluated side)."""
    extra: dict[str, np.ndarray] = field(default_factory=dict)
    """What a logits file keeps of this window (`kept_logits`)."""
    sites: dict[str, WindowSums] = field(default_factory=dict)
    """With --site: each site inside the blocks' sums, as this window's own (with --against,
    B's site rows through B's decoder); layer 0's rows: zeros."""
    blocks: BlockSums | None = None
    """With --site: the check that this window's blocks' pieces add up."""


def mean_and_uncertainty(s: float, s2: float, n: int) -> tuple[float, float]:
    """llama.cpp's `mean_and_uncertainty`."""
    if n < 1:
        return 0.0, 0.0
    f = s / n
    df = s2 / n - f * f
    return f, math.sqrt(df / (n - 1)) if df > 0 and n > 10 else 0.0


def covariance(sa: float, sb: float, sab: float, n: int) -> float:
    """llama.cpp's `covariance` of two means."""
    if n < 10:
        return 0.0
    return (sab / n - (sa / n) * (sb / n)) / (n - 1)


def percentile(values: np.ndarray, fraction: float) -> float:
    """llama.cpp's `percentile` of sorted values (float64 here, float32 there)."""
    if fraction <= 0:
        return float(values[0])
    if fraction >= 1:
        return float(values[-1])
    p = fraction * (len(values) - 1)
    ip = int(p)
    p -= ip
    return float((1 - p) * values[ip] + p * values[min(ip + 1, len(values) - 1)])


def quantiles(values: np.ndarray, at: tuple[tuple[str, float], ...]) -> dict[str, float]:
    """The named percentiles of unsorted values (the median the mean of the two middle values
    when their number is even, as llama.cpp's)."""
    v = np.sort(values.astype(np.float64))
    return {name: float(np.median(v)) if name == "median" else percentile(v, f) for name, f in at}


def _nll(s: dict[str, float], n: int) -> tuple[float, float, float, float, float, float]:
    """The mean NLL of the reference and of the evaluated side, each ±, their covariance, and
    the uncertainty of ln(PPL(evaluated)/PPL(reference))."""
    a, a_err = mean_and_uncertainty(s["nll_a"], s["nll_a2"], n)
    b, b_err = mean_and_uncertainty(s["nll_b"], s["nll_b2"], n)
    cov = covariance(s["nll_b"], s["nll_a"], s["nll_ab"], n)
    return a, a_err, b, b_err, cov, math.sqrt(max(a_err**2 + b_err**2 - 2 * cov, 0.0))


class TextTotals:
    """Every window's sums, combined in window order."""

    def __init__(self, layers: list[int], windows: list[WindowSums]) -> None:
        self.layers = layers
        self.pair_layers = layers
        """The layers a comparison has (a logits file: the output alone)."""
        self.windows = windows
        """Every window's sums, in window order."""
        self.n = sum(w.n for w in self.windows)
        self.n_bytes = sum(w.n_bytes for w in self.windows)

    def _each(self, site: str) -> list[WindowSums]:
        """Every window's sums of `site` (the residual stream's: the window's own)."""
        return [w if site == "resid" else w.sites[site] for w in self.windows]

    def _sum(self, name: str, site: str = "resid") -> np.ndarray:
        parts = [w.sums[name] for w in self._each(site)]
        out: np.ndarray = np.zeros_like(parts[0])
        for part in parts:  # in window order: the same bits however the windows were split
            out += part
        return out

    def _rows(self, key: str, site: str, prefix: str = "") -> list[dict[str, Any]]:
        """Each layer's `ROW_STATS` over every window (in window order), by report field
        (`prefix` before each name: the evaluated side's)."""
        if not ROW_STATS:
            return [{} for _ in self.layers]
        each = [w.rows[key] for w in self._each(site)]
        out = []
        for i in range(len(each[0])):
            acc = Sums()
            for part in each:
                acc.update(part[i])
            values = acc.values(stat.summary for stat in ROW_STATS.values())
            out.append({prefix + name: value for name, value in values.items()})
        return out

    def one(self, key: str = "one", site: str = "resid") -> list[TextLayer]:
        """Per layer statistics of the lens (`key` 'logit': the logit lens's, beside a tuned
        lens; `site`: of a site inside the blocks)."""
        sums, rows = self._sum(key, site), self._rows(key, site)
        n, n_bytes = self.n, self.n_bytes
        out = []
        for i, layer in enumerate(self.layers):
            nll, nll2, kl, ent, top1 = (float(x) for x in sums[i])
            ce, err = mean_and_uncertainty(nll, nll2, n)
            bpb = nll / math.log(2) / n_bytes if n_bytes else math.nan
            out.append(TextLayer(layer, ce, err, bpb, kl / n, ent / n, top1 / n, **rows[i]))
        return out

    def perplexity(self) -> tuple[float, float]:
        """The output's PPL ± (the last layer's NLL sums)."""
        nll, nll2 = (float(x) for x in self._sum("one")[-1][:2])
        f, df = mean_and_uncertainty(nll, nll2, self.n)
        return math.exp(f), math.exp(f) * df

    def pair(self, residual: bool, site: str = "resid") -> list[TextPairLayer]:
        """Per layer llama.cpp's KL table (reference: this model; evaluated: the other;
        `site`: of a site inside the blocks)."""
        sums, n, each = self._sum("pair", site), self.n, self._each(site)
        kl_values = np.concatenate([w.values["kl"] for w in each], 1)
        dp_values = np.concatenate([w.values["dp"] for w in each], 1)
        rows = self._rows("against", site, "against_") if "against" in each[0].rows else None
        out = []
        for i, layer in enumerate(self.pair_layers):
            s = dict(zip(PAIR, (float(x) for x in sums[i]), strict=True))
            kl, kl_err = mean_and_uncertainty(s["kl"], s["kl2"], n)
            same = s["same"] / n
            same_err = math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0
            dp, dp_err = mean_and_uncertainty(s["dp"], s["dp2"], n)
            mse, mse_err = mean_and_uncertainty(s["dp2"], s["dp4"], n)
            rms = math.sqrt(mse)
            a, _, b, _, _, ratio_err = _nll(s, n)
            out.append(
                TextPairLayer(
                    layer=layer,
                    kl=kl,
                    kl_err=kl_err,
                    kl_percentiles=quantiles(kl_values[i], KL_AT),
                    same_top=same,
                    same_top_err=same_err,
                    dp_mean=dp,
                    dp_mean_err=dp_err,
                    dp_rms=rms,
                    dp_rms_err=0.5 / rms * mse_err if rms > 0 else 0.0,
                    dp_percentiles=quantiles(dp_values[i], DP_AT),
                    cross_entropy_evaluated=b,
                    ln_ppl_ratio=b - a,
                    ln_ppl_ratio_err=ratio_err,
                    residual_kl=s["res_kl"] / n if residual else None,
                    **({} if rows is None else rows[i]),
                )
            )
        return out

    def pair_output(self) -> TextPairOutput:
        """llama.cpp's 'Perplexity statistics' at the output."""
        s = dict(zip(PAIR, (float(x) for x in self._sum("pair")[-1]), strict=True))
        a, a_err, b, b_err, cov, ln_err = _nll(s, self.n)
        ppl_a, ppl_b = math.exp(a), math.exp(b)
        ppl_a_err, ppl_b_err = ppl_a * a_err, ppl_b * b_err
        ratio = math.exp(b - a)
        diff_err = math.sqrt(max(ppl_a_err**2 + ppl_b_err**2 - 2 * ppl_a * ppl_b * cov, 0.0))
        return TextPairOutput(
            ppl_reference=ppl_a,
            ppl_reference_err=ppl_a_err,
            ppl_evaluated=ppl_b,
            ppl_evaluated_err=ppl_b_err,
            cor=cov / (a_err * b_err) if a_err > 0 and b_err > 0 else math.nan,
            ln_ratio=b - a,
            ln_ratio_err=ln_err,
            ratio=ratio,
            ratio_err=ratio * ln_err,
            diff=ppl_b - ppl_a,
            diff_err=diff_err,
        )

    def site_rows(self, sites: tuple[str, ...], kind: type[Any], per_site: Any) -> list[Any]:
        """A row of `kind` per (layer, site) in block order, from `per_site(site)`'s rows per
        layer (layer 0: the embedding's residual stream alone)."""
        from embedlens.analysis.lens.options import SUFFIX

        each = {site: per_site(site) for site in sites}
        return [
            kind(**asdict(each[site][i]), site=site, row=f"{layer}{SUFFIX[site]}")
            for i, layer in enumerate(self.layers)
            for site in sites
            if site == "resid" or layer >= 1
        ]


@dataclass(frozen=True)
class LogitsFile:
    """A saved run's output (`--save-logits`): `meta` (model, ctx, stride, score, vocab, top_k,
    windows), the text's token ids, and per scored token the arrays of `KEYS`."""

    path: str
    meta: dict[str, Any]
    tokens: np.ndarray
    rows: dict[str, np.ndarray]
    starts: np.ndarray
    """Each window's first row in `rows`."""

    def window(self, index: int) -> dict[str, np.ndarray]:
        """The rows of window `index`."""
        a, b = int(self.starts[index]), int(self.starts[index + 1])
        return {k: v[a:b] for k, v in self.rows.items()}

    def check_run(self, tokens: list[int], ctx: int, stride: int, score: str, vocab: int) -> None:
        """Refuse a file made from another text, window rule or vocabulary."""
        m = self.meta
        mine = {"ctx": ctx, "stride": stride, "score": score, "vocab": vocab}
        for key, value in mine.items():
            if m.get(key) != value:
                raise UsageError(
                    f"--against-logits {self.path} was saved with {key} {m.get(key)}, this run "
                    f"has {value}",
                    hint="run with the options the file was saved with",
                )
        if len(self.tokens) != len(tokens) or not np.array_equal(self.tokens, tokens):
            raise UsageError(
                f"--against-logits {self.path} holds another text's tokens "
                f"({len(self.tokens):,} tokens; this run {len(tokens):,})",
                hint="give the same --text and --max-tokens, and models of the same tokenizer",
            )


def read_logits(path: str | os.PathLike[str]) -> LogitsFile:
    """Read a file `--save-logits` wrote (`_save`); anything else is refused with one line."""
    import zipfile

    name = os.fspath(path)
    try:
        with np.load(name, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            if meta.get("format") != FORMAT:
                raise ValueError(meta.get("format"))
            tokens = z["tokens"]
            rows = {k: z[k] for k in KEYS}
    except FileNotFoundError:
        raise UsageError(f"--against-logits {name}: no such file") from None
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, UnicodeDecodeError) as e:
        raise UsageError(
            f"--against-logits {name} is not a logits file of lens --text --save-logits ({e})"
        ) from None
    starts = np.concatenate([[0], np.cumsum(meta["windows"])])
    return LogitsFile(name, meta, tokens, rows, starts)


def save_logits(
    path: str | os.PathLike[str], meta: dict[str, Any], ids: list[int], done: list[WindowSums]
) -> None:
    """The output's rows each window kept (`text_run.kept_logits`) written as a logits file,
    with the run's `meta` and the text's token ids."""
    head = {**meta, "format": FORMAT, "windows": [len(w.extra["top1"]) for w in done]}
    arrays: dict[str, Any] = {"meta": np.frombuffer(json.dumps(head).encode(), dtype=np.uint8)}
    arrays["tokens"] = np.asarray(ids, dtype=np.int32)
    arrays.update({k: np.concatenate([w.extra[k] for w in done]) for k in KEYS})
    with open(path, "wb") as f:
        np.savez(f, **arrays)
