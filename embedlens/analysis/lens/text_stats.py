"""What the windows of `lens --text` leave: their sums, read out with llama-perplexity's
definitions (tools/perplexity's `kl_divergence`: docs/text.md gives each) into the report's rows
(`TextTotals`; `text_run.text_report` builds the report).

Each window leaves float64 sums per layer (`WindowSums`) and, for a comparison, the per-token KL
and Δp values (float32, tokens x layers: llama.cpp keeps the same to sort them). Windows are
combined in window order whichever process ran them, so a split run gives the same sums.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from embedlens.analysis.lens.stats import ROW_STATS, Sums
from embedlens.reports.lens import BlockSums
from embedlens.reports.lens_text import TextLayer, TextPairLayer, TextPairOutput

ONE = ("nll", "nll2", "kl", "entropy", "top1")
"""Sums per layer of one model: NLL, NLL², KL(output ‖ lens), entropy, top-1 hits."""
PAIR = tuple("nll_a nll_a2 nll_b nll_b2 nll_ab kl kl2 dp dp2 dp4 same res_kl".split())
"""Sums per layer of a comparison (a: the reference, b: the evaluated side)."""

DP_AT = (("max", 1.0), ("99.9", 0.999), ("99", 0.99), ("95", 0.95), ("90", 0.9), ("75", 0.75),
         ("median", 0.5), ("25", 0.25), ("10", 0.1), ("5", 0.05), ("1", 0.01), ("0.1", 0.001),
         ("min", 0.0))  # fmt: skip
"""The percentiles of Δp llama-perplexity gives; of KL, the same but the quartiles."""
KL_AT = tuple(at for at in DP_AT if at[0] not in ("75", "25"))


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
        each = [w.rows[key] for w in self._each(site) if key in w.rows]
        if not each:  # no `ROW_STATS`, or a logits file's evaluated side
            return [{} for _ in self.layers]
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
        values = {k: np.concatenate([w.values[k] for w in each], 1) for k in ("kl", "dp")}
        rows = self._rows("against", site, "against_")
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
                    kl_percentiles=quantiles(values["kl"][i], KL_AT),
                    same_top=same,
                    same_top_err=same_err,
                    dp_mean=dp,
                    dp_mean_err=dp_err,
                    dp_rms=rms,
                    dp_rms_err=0.5 / rms * mse_err if rms > 0 else 0.0,
                    dp_percentiles=quantiles(values["dp"][i], DP_AT),
                    cross_entropy_evaluated=b,
                    ln_ppl_ratio=b - a,
                    ln_ppl_ratio_err=ratio_err,
                    residual_kl=s["res_kl"] / n if residual else None,
                    **rows[i],
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
