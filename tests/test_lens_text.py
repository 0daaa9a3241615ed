"""`lens --text`: per-layer statistics over a text, and llama-perplexity's KL table per layer.

The output layer's figures are checked against a plain numpy computation over the same logits
(llama.cpp's definitions, tools/perplexity/perplexity.cpp), the per-layer cross-entropy against
plain transformers (output_hidden_states, final norm, head), a model against itself and against
a copy with one block changed, SmolLM2 against its Q8_0 rounding, a saved base file, torchrun,
and the refusals.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.models import WORDS

CTX = 16


def words_text(path: Path, n: int = 200, seed: int = 3) -> Path:
    """A text of the tiny models' words (every word one token)."""
    rng = random.Random(seed)
    path.write_text(" ".join(rng.choices(WORDS, k=n)) + "\n", encoding="utf-8")
    return path


def changed_copy(folder: Path, out: Path, block: int) -> Path:
    """The tiny model with block `block` (1-based: its output is layer `block`) changed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        w = model.model.layers[block - 1].mlp.down_proj.weight
        w.add_(0.05 * torch.randn(w.shape, generator=torch.Generator().manual_seed(5)))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder).save_pretrained(out)
    return out


def windows_by_hand(folder: Path, text: str, ctx: int) -> tuple[list[list[int]], list[int]]:
    """The windows llama-perplexity cuts (stride ctx, BOS first when the tokenizer adds one)
    and the positions it scores (the second half)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok(text)["input_ids"]
    bos = tok.bos_token_id if tok("a")["input_ids"][:1] == [tok.bos_token_id] else None
    out = []
    for start in range(0, len(ids) - ctx + 1, ctx):
        w = list(ids[start : start + ctx])
        if bos is not None:
            w[0] = bos
        out.append(w)
    return out, list(range(ctx // 2, ctx - 1))


def logits_of(folder: Path, wins: list[list[int]], pos: list[int]) -> tuple[Any, Any]:
    """Every layer's logits at the scored positions (float64 numpy [layers, tokens, V]), by
    plain transformers: output_hidden_states, then the final norm and the head (the last layer:
    the model's logits); and the true next tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    per_layer: list[list[Any]] = []
    targets = []
    with torch.no_grad():
        for w in wins:
            out = model(torch.tensor([w]), output_hidden_states=True)
            hs = out.hidden_states
            rows = []
            for i in range(len(hs) - 1):
                rows.append(model.lm_head(model.model.norm(hs[i][0, pos])).double().numpy())
            rows.append(out.logits[0, pos].double().numpy())
            per_layer.append(rows)
            targets += [w[j + 1] for j in pos]
    stacked = np.stack([np.concatenate([r[i] for r in per_layer]) for i in range(len(hs))])
    return stacked, np.array(targets)


def log_softmax(x: Any) -> Any:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def mean_unc(x: Any) -> tuple[float, float]:
    """llama.cpp's mean_and_uncertainty."""
    n = len(x)
    f = x.sum() / n
    df = (x * x).sum() / n - f * f
    return f, math.sqrt(df / (n - 1)) if df > 0 and n > 10 else 0.0


def pct(v: Any, f: float) -> float:
    """llama.cpp's percentile of sorted values."""
    if f <= 0:
        return float(v[0])
    if f >= 1:
        return float(v[-1])
    p = f * (len(v) - 1)
    i = int(p)
    p -= i
    return float((1 - p) * v[i] + p * v[min(i + 1, len(v) - 1)])


def close(a: float, b: float, tol: float = 2e-5) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(a), abs(b))


@pytest.fixture(scope="module")
def pair(tiny, tmp_path_factory):
    folder = tiny("llama-untied")
    other = changed_copy(folder, tmp_path_factory.mktemp("changed"), block=2)
    text = words_text(tmp_path_factory.mktemp("text") / "words.txt")
    return folder, other, text


def test_output_statistics_equal_numpy_with_llama_cpp_definitions(pair):
    from embedlens import lens_text

    a, b, text = pair
    r = lens_text(a, text, ctx=CTX, against=b)
    wins, pos = windows_by_hand(a, text.read_text(), CTX)
    la_all, t = logits_of(a, wins, pos)
    lb_all, _ = logits_of(b, wins, pos)
    assert r.n_windows == len(wins) and r.n_scored == len(t) == len(wins) * (CTX - 1 - CTX // 2)
    la, lb = log_softmax(la_all[-1]), log_softmax(lb_all[-1])
    n = len(t)
    nll_a, nll_b = -la[np.arange(n), t], -lb[np.arange(n), t]
    kl = (np.exp(la) * (la - lb)).sum(-1)
    dp = np.exp(-nll_b) - np.exp(-nll_a)
    vocab = 4 + len(WORDS)
    same = (la_all[-1][:, :vocab].argmax(-1) == lb_all[-1][:, :vocab].argmax(-1)).mean()
    out, o = r.pair[-1], r.pair_output
    assert out.layer == r.num_layers
    f, df = mean_unc(kl)
    assert close(out.kl, f) and close(out.kl_err, df, 1e-3)
    ks = np.sort(kl)
    assert close(out.kl_percentiles["max"], ks[-1]) and close(out.kl_percentiles["min"], ks[0])
    for name, frac in (("99.9", 0.999), ("99", 0.99), ("90", 0.9), ("10", 0.1)):
        assert close(out.kl_percentiles[name], pct(ks, frac)), name
    mid = n // 2
    median = 0.5 * (ks[mid] + ks[mid - 1]) if n % 2 == 0 else ks[mid]
    assert close(out.kl_percentiles["median"], median)
    assert out.same_top == same
    assert close(out.same_top_err, math.sqrt(same * (1 - same) / (n - 1)))
    f, df = mean_unc(dp)
    assert close(out.dp_mean, f) and close(out.dp_mean_err, df, 1e-3)
    mse, mse_err = mean_unc(dp * dp)
    assert close(out.dp_rms, math.sqrt(mse)) and close(
        out.dp_rms_err, 0.5 / math.sqrt(mse) * mse_err, 1e-3
    )
    ds = np.sort(dp)
    for name, frac in (("99", 0.99), ("75", 0.75), ("25", 0.25), ("1", 0.01)):
        assert close(out.dp_percentiles[name], pct(ds, frac), 1e-4), name
    a_f, a_df = mean_unc(nll_a)
    b_f, b_df = mean_unc(nll_b)
    cov = ((nll_a * nll_b).sum() / n - nll_a.mean() * nll_b.mean()) / (n - 1)
    assert close(o.ppl_reference, math.exp(a_f)) and close(o.ppl_evaluated, math.exp(b_f))
    assert close(o.ppl_reference_err, math.exp(a_f) * a_df, 1e-3)
    assert close(o.ln_ratio, b_f - a_f)
    ln_err = math.sqrt(a_df**2 + b_df**2 - 2 * cov)
    assert close(o.ln_ratio_err, ln_err, 1e-3)
    assert close(o.ratio, math.exp(b_f - a_f)) and close(
        o.ratio_err, math.exp(b_f - a_f) * ln_err, 1e-3
    )
    assert close(o.cor, cov / (a_df * b_df), 1e-3)
    assert close(r.perplexity, math.exp(a_f))


def test_per_layer_cross_entropy_equals_plain_transformers(pair):
    from embedlens import lens_text

    a, _, text = pair
    r = lens_text(a, text, ctx=CTX)
    wins, pos = windows_by_hand(a, text.read_text(), CTX)
    logits, t = logits_of(a, wins, pos)
    n = len(t)
    out_lp = log_softmax(logits[-1])
    assert [x.layer for x in r.layers] == list(range(len(logits)))
    for row, x in zip(r.layers, logits, strict=True):
        lp = log_softmax(x)
        nll = -lp[np.arange(n), t]
        assert close(row.cross_entropy, nll.mean()), row.layer
        assert close(row.kl, (np.exp(out_lp) * (out_lp - lp)).sum(-1).mean(), 1e-4), row.layer
        assert close(row.entropy, -(np.exp(lp) * lp).sum(-1).mean(), 1e-4), row.layer
        vocab = 4 + len(WORDS)
        assert row.top1_accuracy == (x[:, :vocab].argmax(-1) == t).mean()
    assert r.layers[-1].kl == 0.0
    assert r.n_bytes > 0 and close(r.layers[-1].bits_per_byte, nll.sum() / math.log(2) / r.n_bytes)


def test_a_model_against_itself_and_one_block_changed(pair):
    from embedlens import lens_text

    a, b, text = pair
    same = lens_text(a, text, ctx=CTX, against=a)
    for p in same.pair:
        assert p.kl == 0.0 and p.kl_percentiles["max"] == 0.0 and p.same_top == 1.0
        assert p.dp_mean == 0.0 and p.dp_rms == 0.0 and p.ln_ppl_ratio == 0.0
    assert same.pair_output.ratio == 1.0 and same.pair_output.ln_ratio == 0.0
    changed = lens_text(a, text, ctx=CTX, against=b)
    for p in changed.pair:  # block 2 changed: layers 0 and 1 are the same bits
        if p.layer < 2:
            assert p.kl == 0.0 and p.kl_percentiles["max"] == 0.0 and p.same_top == 1.0
        else:
            assert p.kl > 0.0, p.layer


def norm_changed_copy(folder: Path, out: Path) -> Path:
    """The tiny model with block 2 and its final norm changed: another tail than A's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    changed_copy(folder, out, block=2)
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder).save_pretrained(out)
    return out


def residual_kls(a: Path, b: Path, wins: list[list[int]], pos: list[int]) -> list[float]:
    """Per layer below the output: mean KL(A's lens ‖ A's norm and head on B's stream), by plain
    transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    ma, mb = (AutoModelForCausalLM.from_pretrained(f).eval() for f in (a, b))
    sums = np.zeros(ma.config.num_hidden_layers)
    with torch.no_grad():
        for w in wins:
            ha = ma(torch.tensor([w]), output_hidden_states=True).hidden_states
            hb = mb(torch.tensor([w]), output_hidden_states=True).hidden_states
            for i in range(len(sums)):
                la = log_softmax(ma.lm_head(ma.model.norm(ha[i][0, pos])).double().numpy())
                lr = log_softmax(ma.lm_head(ma.model.norm(hb[i][0, pos])).double().numpy())
                sums[i] += (np.exp(la) * (la - lr)).sum()
    return list(sums / (len(wins) * len(pos)))


def test_residual_kl_is_a_decoder_on_the_others_stream(pair, tmp_path):
    """The residual KL, A's decoder on B's stream, against plain transformers: with B's tail
    A's bit for bit (block 2 changed), the run reuses B's own lens rows (`same_tail`); with
    another final norm, it decodes B's stream through A's tail."""
    from transformers import AutoModelForCausalLM

    from embedlens import lens_text
    from embedlens.analysis.lens.text_run import same_tail

    a, b, text = pair
    c = norm_changed_copy(a, tmp_path / "norm")
    ma, mb, mc = (AutoModelForCausalLM.from_pretrained(f) for f in (a, b, c))
    assert same_tail(ma, mb) and not same_tail(ma, mc) and same_tail(ma, ma)
    wins, pos = windows_by_hand(a, text.read_text(), CTX)
    for other in (b, c):
        r = lens_text(a, text, ctx=CTX, against=other)
        expected = residual_kls(a, other, wins, pos)
        for p, want in zip(r.pair[:-1], expected, strict=True):
            assert close(p.residual_kl, want, 1e-4), (other.name, p.layer)
        if other == b:  # the tail is the same: A's decoder on B's stream is B's lens
            assert all(p.residual_kl == p.kl for p in r.pair[:-1])


def test_saved_logits_serve_as_the_base(pair, tmp_path):
    from embedlens import lens_text

    a, b, text = pair
    saved = tmp_path / "base.npz"
    lens_text(a, text, ctx=CTX, save_logits=saved)
    live = lens_text(a, text, ctx=CTX, against=b)
    read = lens_text(b, text, ctx=CTX, against_logits=saved)
    assert len(read.pair) == 1 and read.pair[0].layer == read.num_layers
    x, y = live.pair[-1], read.pair[0]
    # the tiny vocabulary fits in the file's top-k: the file holds every log-probability
    assert close(x.kl, y.kl, 1e-4) and x.same_top == y.same_top
    assert close(x.dp_mean, y.dp_mean, 1e-4) and close(x.dp_rms, y.dp_rms, 1e-4)
    assert close(live.pair_output.ratio, read.pair_output.ratio)
    assert close(live.pair_output.ppl_reference, read.pair_output.ppl_reference)


def test_windows_strides_and_all_scored(pair):
    from embedlens import lens_text

    a, _, text = pair
    r = lens_text(a, text, ctx=CTX, score="all", max_tokens=64)
    assert r.n_text_tokens == 64 and r.n_windows == 4 and r.n_scored == 4 * (CTX - 1)
    s = lens_text(a, text, ctx=CTX, stride=4, max_tokens=64)
    assert s.n_windows == (64 - CTX) // 4 + 1 and s.n_scored == s.n_windows * 4


def test_cli_text_json_and_table(pair, cli):
    a, b, text = pair
    data = cli.json("lens", a, "--text", text, "--ctx", CTX, "--against", b)
    assert data["command"] == "lens" and data["ctx"] == CTX and len(data["pair"]) == 4
    assert data["pair"][-1]["kl_percentiles"]["99.9"] >= data["pair"][-1]["kl_percentiles"]["90"]
    shown = cli("lens", a, "--text", text, "--ctx", CTX, "--against", b)
    assert shown.exit_code == 0, shown.stderr
    assert "Mean PPL(Q)/PPL(base)" in shown.stdout and "mean KLD" in shown.stdout


def test_refusals(pair, cli, tmp_path):
    a, b, text = pair
    binary = tmp_path / "bin.dat"
    binary.write_bytes(b"\x00\x01\x02abc")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n", encoding="utf-8")
    short = words_text(tmp_path / "short.txt", n=5)
    assert "is not text" in cli.fails("lens", a, "--text", binary, code=2)
    assert "not UTF-8" in cli.fails("lens", a, "--text", latin, code=2)
    assert "is empty" in cli.fails("lens", a, "--text", empty, code=2)
    assert "fewer than one window" in cli.fails("lens", a, "--text", short, "--ctx", CTX, code=2)
    assert "no such file" in cli.fails("lens", a, "--text", tmp_path / "none.txt", code=2)
    assert "--ctx" in cli.fails("lens", a, "--text", text, "--ctx", "2", code=2)
    assert "positions" in cli.fails("lens", a, "--text", text, "--ctx", "4096", code=2)
    assert "--score" in cli.fails("lens", a, "--text", text, "--score", "most", code=2)
    assert "not both" in cli.fails("lens", a, "--text", text, "--against", b, "--against-logits",
                                   text, code=2)  # fmt: skip
    assert "logits file" in cli.fails("lens", a, "--text", text, "--ctx", CTX, "--against-logits",
                                      text, code=2)  # fmt: skip
    nothing = tmp_path / "nothing.npz"  # numpy's reader ends in EOFError on an empty file
    nothing.write_bytes(b"")
    assert "logits file" in cli.fails("lens", a, "--text", text, "--ctx", CTX, "--against-logits",
                                      nothing, code=2)  # fmt: skip
    assert "do not combine" in cli.fails("lens", a, "Hello", "--text", text, code=2)
    assert "-k do not combine" in cli.fails("lens", a, "--text", text, "-k", "3", code=2)
    assert "apply with --text" in cli.fails("lens", a, "--save-logits", tmp_path / "x.npz", code=2)


@pytest.mark.slow
def test_smollm2_against_its_q8_0_rounding(smollm2, tmp_path):
    import subprocess
    import sys

    from embedlens import lens_text

    root = Path(__file__).resolve().parent.parent
    q8 = tmp_path / "q8.gguf"
    subprocess.run([sys.executable, str(root / "bench" / "retype_gguf.py"), str(smollm2), str(q8),
                    "Q8_0"], check=True, capture_output=True)  # fmt: skip
    text = license_text(tmp_path / "text.txt")
    # every third layer (0, 3, ..., 30: the output) and 512 tokens (two windows): for the suite's
    # time, not the statistics' (on 512: output KL 0.0102, top-1 agreement 0.95, the last four
    # layers' KL 18.5 times the first three's, ln ratio -0.015; on 1,024: 0.0076, 0.97, 15 and
    # -0.014)
    r = lens_text(smollm2, text, ctx=256, max_tokens=512, against=q8, residual=False,
                  layers="0:31:3")  # fmt: skip
    kls = [p.kl for p in r.pair]
    assert len(kls) == 11  # the output, layer 30, among them
    assert kls[0] == 0.0  # the embedding table is copied (token_embd is Q8_0 already)
    assert 0 < kls[-1] < 0.05 and r.pair[-1].same_top > 0.9
    first, last = np.mean(kls[1:4]), np.mean(kls[-4:])
    assert last > 3 * first > 0  # the rounding's error grows with depth
    assert abs(r.pair_output.ln_ratio) < 0.05


def license_text(path: Path) -> Path:
    """A few thousand tokens of English: the license texts installed packages ship."""
    import glob
    import sysconfig

    site = sysconfig.get_paths()["purelib"]
    parts = []
    for name in sorted(glob.glob(f"{site}/*.dist-info/LICENSE*"))[:40]:
        try:
            parts.append(Path(name).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, IsADirectoryError):
            continue
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("windows", ["many", "one"])
def test_torchrun_gives_what_one_process_gives(pair, cli, windows):
    """Two processes give one process's JSON; with one window (`--max-tokens`), rank 1 runs none
    and still takes part in every exchange (it used to wait alone for the self-check's)."""
    from tests.test_dist import torchrun

    a, _, text = pair
    args = ["lens", a, "--text", text, "--ctx", CTX, "--stride", 8, "--json"]
    args += ["--max-tokens", CTX] if windows == "one" else []
    one = cli(*args)
    assert one.exit_code == 0, one.stderr
    two = torchrun(*args)
    assert two.returncode == 0, two.stderr
    x, y = json.loads(one.stdout), json.loads(two.stdout)
    assert x == y


def test_tuned_lens_statistics_beside_the_logit_lens(pair, tmp_path):
    """--tuned: each layer's CE is that of unembed(h + W h + b) by hand; the logit lens's
    statistics beside equal a run without --tuned."""
    import torch
    from transformers import AutoModelForCausalLM

    from embedlens import lens_text
    from tests.test_tune import tuned_lens_folder

    a, _, text = pair
    model = AutoModelForCausalLM.from_pretrained(a).eval()
    lens_dir = tuned_lens_folder(tmp_path / "lens", model)
    r = lens_text(a, text, ctx=CTX, tuned=lens_dir)
    plain = lens_text(a, text, ctx=CTX)
    assert r.lens == "tuned" and r.logit_layers is not None
    for x, y in zip(r.logit_layers, plain.layers, strict=True):
        assert close(x.cross_entropy, y.cross_entropy, 1e-6) and x.kl == pytest.approx(
            y.kl, abs=1e-6
        )
    state = torch.load(lens_dir / "params.pt", weights_only=True)
    wins, pos = windows_by_hand(a, text.read_text(), CTX)
    n_layers = model.config.num_hidden_layers
    nll: dict[int, list[float]] = {}
    with torch.no_grad():
        for w in wins:
            out = model(torch.tensor([w]), output_hidden_states=True)
            t = torch.tensor(w)[torch.tensor(pos) + 1]
            for layer in range(n_layers):
                h = out.hidden_states[layer][0, pos]
                wt, b = state[f"{layer}.weight"], state[f"{layer}.bias"]
                lp = model.lm_head(model.model.norm(h + h @ wt.T + b)).double().log_softmax(-1)
                nll.setdefault(layer, []).extend((-lp.gather(1, t[:, None])[:, 0]).tolist())
    for row in r.layers[:-1]:
        assert close(row.cross_entropy, float(np.mean(nll[row.layer])), 1e-4), row.layer
    assert r.layers[-1].cross_entropy == pytest.approx(plain.layers[-1].cross_entropy, rel=1e-9)


def test_plot_draws_the_curves(pair, cli, tmp_path):
    pytest.importorskip("matplotlib")
    a, b, text = pair
    plot = tmp_path / "text.svg"
    result = cli("lens", a, "--text", text, "--ctx", CTX, "--against", b, "--plot", plot)
    assert result.exit_code == 0, result.stderr
    assert f"wrote {plot}" in result.stderr and "<svg" in plot.read_text(encoding="utf-8")
