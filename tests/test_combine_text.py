"""`lens --text` combined with the parts it once refused: `--site` (the corpus statistics of each
site inside the blocks) and `--save-states` (each window's residual stream, a file a window).

Each combination equals the runs it is composed from: `--site resid` is `--text` byte for byte;
a site's row is the statistic of that site's rows, taken by plain forward hooks and decoded by
the tail written out by hand (tests/test_sites.py, tests/test_lens.py); a saved window decodes
as the one-prompt run on that window's ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.models import WORDS
from tests.test_lens_text import CTX, close, log_softmax, windows_by_hand, words_text

EVERY = "attn_out,resid_mid,mlp_out,resid"


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return words_text(tmp_path_factory.mktemp("text") / "words.txt", n=80)


def test_site_resid_is_the_text_run_byte_for_byte(tiny, cli, text):
    a = tiny("llama-untied")
    for shown in ([], ["--json"]):
        plain = cli("lens", a, "--text", text, "--ctx", CTX, "--layers", "0,2", *shown)
        site = cli("lens", a, "--text", text, "--ctx", CTX, "--layers", "0,2", "--site", "resid",
                   *shown)  # fmt: skip
        assert plain.exit_code == site.exit_code == 0, site.stderr
        assert site.stdout == plain.stdout


def site_rows_by_hand(
    folder: Path, family: str, text: Path
) -> tuple[dict[tuple[str, int], np.ndarray], np.ndarray, np.ndarray]:
    """Each (site, layer)'s rows over the scored tokens, the pieces by forward hooks
    (`reference_pieces`) and each row through the tail by hand; the output's log-probabilities
    and the true next tokens."""
    import torch

    from tests.test_lens import _load, reference_tail
    from tests.test_sites import reference_pieces

    model = _load(folder)
    wins, pos = windows_by_hand(folder, text.read_text(), CTX)
    rows: dict[tuple[str, int], list[Any]] = {}
    outs, targets = [], []
    with torch.no_grad():
        for w in wins:
            outs.append(model(torch.tensor([w])).logits[0, pos].double().numpy())
            targets += [w[j + 1] for j in pos]
            for layer, r in enumerate(reference_pieces(model, family, w), start=1):
                streams = {"attn_out": r["attn"], "mlp_out": r["mlp"]}
                if family != "gpt-neox":
                    streams["resid_mid"] = r["pre"] + r["attn"]
                for site, h in streams.items():
                    logits = reference_tail(model, family, h[pos]).double().numpy()
                    rows.setdefault((site, layer), []).append(logits)
    joined = {key: np.concatenate(parts) for key, parts in rows.items()}
    return joined, log_softmax(np.concatenate(outs)), np.array(targets)


def by_hand(folder: Path, family: str, text: Path) -> dict[tuple[str, int], dict[str, float]]:
    """Each (site, layer)'s statistics over the scored tokens (`site_rows_by_hand`), against
    the model's own logits."""
    rows, out, t = site_rows_by_hand(folder, family, text)
    n, vocab = len(t), 4 + len(WORDS)
    stats = {}
    for key, x in rows.items():
        lp = log_softmax(x)
        stats[key] = {
            "cross_entropy": float(-lp[np.arange(n), t].mean()),
            "kl": float((np.exp(out) * (out - lp)).sum(-1).mean()),
            "entropy": float(-(np.exp(lp) * lp).sum(-1).mean()),
            "top1_accuracy": float((x[:, :vocab].argmax(-1) == t).mean()),
        }
    return stats


@pytest.mark.parametrize("family", ["llama-untied", "gpt-neox"])
def test_site_rows_equal_hooks_and_the_tail_by_hand(tiny, text, family):
    from embedlens import lens_text

    folder = tiny(family)
    sites = "attn_out,mlp_out" if family == "gpt-neox" else EVERY
    r = lens_text(folder, text, ctx=CTX, site=sites)
    want = by_hand(folder, family, text)
    inner = [row for row in r.layers if row.site != "resid"]
    assert sorted((row.site, row.layer) for row in inner) == sorted(want)
    for row in inner:
        w = want[(row.site, row.layer)]
        assert close(row.cross_entropy, w["cross_entropy"]), row
        assert close(row.kl, w["kl"], 1e-4) and close(row.entropy, w["entropy"], 1e-4), row
        assert row.top1_accuracy == w["top1_accuracy"], row
    assert r.block_sums is not None and r.block_sums.max_abs_error <= r.block_sums.tolerance
    assert r.block_sums.structure == ("parallel" if family == "gpt-neox" else "sequential")


def test_resid_rows_beside_the_sites_are_the_plain_runs(tiny, text):
    from dataclasses import asdict

    from embedlens import lens_text

    a = tiny("llama-untied")
    plain = lens_text(a, text, ctx=CTX, layers="0,2")
    r = lens_text(a, text, ctx=CTX, layers="0,2", site=["mlp_out", "resid"])
    assert r.sites == ["mlp_out", "resid"]
    assert [row.row for row in r.layers] == ["0", "2.mlp", "2", "3.mlp", "3"]
    resid = [row for row in r.layers if row.site == "resid"]
    for mine, own in zip(resid, plain.layers, strict=True):
        assert {k: v for k, v in asdict(mine).items() if k not in ("site", "row")} == asdict(own)
    assert (r.perplexity, r.n_scored, r.n_bytes) == (plain.perplexity, plain.n_scored,
                                                     plain.n_bytes)  # fmt: skip
    alone = lens_text(a, text, ctx=CTX, layers="0,2", site="mlp_out")
    assert [row.row for row in alone.layers] == ["2.mlp", "3.mlp"]
    assert alone.layers == [row for row in r.layers if row.site == "mlp_out"]


def test_the_sites_in_json_and_in_the_table(tiny, cli, text, tmp_path):
    a = tiny("llama-untied")
    data = cli.json("lens", a, "--text", text, "--ctx", CTX, "--site", EVERY)
    assert data["sites"] == ["attn_out", "resid_mid", "mlp_out", "resid"]
    assert [row["row"] for row in data["layers"][:5]] == ["0", "1.attn", "1.mid", "1.mlp", "1"]
    assert {row["site"] for row in data["layers"]} == set(data["sites"])
    assert data["block_sums"]["structure"] == "sequential"
    shown = cli("lens", a, "--text", text, "--ctx", CTX, "--site", "attn_out,resid")
    assert shown.exit_code == 0, shown.stderr
    assert "1.attn" in shown.stdout and "3 out" in shown.stdout and "pieces add up" in shown.stdout
    plot = tmp_path / "curves.png"
    drawn = cli("lens", a, "--text", text, "--ctx", CTX, "--site", "mlp_out,resid", "--plot", plot)
    assert drawn.exit_code == 0, drawn.stderr
    assert plot.stat().st_size > 0


def test_against_logits_with_sites_compares_the_output_as_without(tiny, text, tmp_path):
    from embedlens import lens_text

    a = tiny("llama-untied")
    saved = tmp_path / "base.npz"
    lens_text(a, text, ctx=CTX, save_logits=saved)
    plain = lens_text(a, text, ctx=CTX, against_logits=saved)
    r = lens_text(a, text, ctx=CTX, against_logits=saved, site="attn_out,resid")
    assert r.pair == plain.pair and r.pair_output == plain.pair_output


def test_what_stays_refused(tiny, cli, text, tmp_path):
    a, b = tiny("llama-untied"), tiny("llama-tied")
    said = cli.fails("lens", a, "--text", text, "--tuned", tmp_path / "none", "--site",
                     "attn_out", code=2)  # fmt: skip
    assert "--tuned reads the residual stream only" in said
    said = cli.fails("lens", tiny("gpt-neox"), "--text", text, "--ctx", CTX, "--site",
                     "resid_mid", code=1)  # fmt: skip
    assert "--site resid_mid does not exist in block 1" in said
    file = tmp_path / "file"
    file.write_text("x")
    said = cli.fails("lens", a, "--text", text, "--save-states", file, code=2)
    assert "with --text it names a folder, where each window's states go" in said
    said = cli.fails("lens", a, "--text", text, "--against", b, "--save-states", tmp_path / "d",
                     code=2)  # fmt: skip
    assert "save each model's alone" in said


def test_each_window_saved_decodes_as_the_one_prompt_run_on_its_ids(tiny, cli, text, tmp_path):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from embedlens import lens, lens_states, lens_text

    a = tiny("llama-untied")
    folder = tmp_path / "states"
    r = lens_text(a, text, ctx=CTX, stride=12, save_states=folder)
    names = sorted(p.name for p in folder.iterdir())
    assert names == [f"{i:06d}.safetensors" for i in range(1, r.n_windows + 1)]
    tok = AutoTokenizer.from_pretrained(a)
    ids = tok(text.read_text())["input_ids"]
    for i, name in enumerate(names):
        with safe_open(str(folder / name), framework="pt") as f:
            meta, saved = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        assert meta["window"] == str(i + 1) and meta["start"] == str(12 * i)
        assert meta["text"] == str(text)
        assert saved["token_ids"].tolist() == ids[12 * i : 12 * i + CTX]
        prompt = tok.decode(saved["token_ids"].tolist())
        alone = tmp_path / f"alone{i}.safetensors"
        one = lens(a, prompt, save_states=alone)
        assert [t.id for t in one.tokens] == saved["token_ids"].tolist()
        with safe_open(str(alone), framework="pt") as f:
            assert all(f.get_tensor(k).equal(saved[k]) for k in saved)
        decoded = lens_states(a, folder / name)
        assert decoded.layers == one.layers and decoded.tokens == one.tokens
    said = cli("lens", a, "--text", text, "--ctx", CTX, "--save-states", tmp_path / "cli", "--json")
    assert said.exit_code == 0 and "each window's states" in said.stderr
    plain = cli("lens", a, "--text", text, "--ctx", CTX, "--json")
    assert said.stdout == plain.stdout


@pytest.mark.slow
def test_torchrun_merges_the_sites_and_saves_every_window(tiny, cli, text, tmp_path):
    from tests.test_dist import torchrun

    a = tiny("llama-untied")
    args = ["lens", a, "--text", text, "--ctx", CTX, "--stride", 8, "--json", "--site", EVERY]
    one = cli(*args, "--save-states", tmp_path / "one")
    assert one.exit_code == 0, one.stderr
    two = torchrun(*args, "--save-states", tmp_path / "two")
    assert two.returncode == 0, two.stderr
    assert json.loads(one.stdout) == json.loads(two.stdout)
    alone = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert alone == sorted(p.name for p in (tmp_path / "two").iterdir()) and len(alone) > 2
    for name in alone:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


def test_against_site_rows_equal_both_models_site_rows_by_hand(tiny, text):
    """`--text --against --site`: each (layer, site) row's comparison is llama-perplexity's
    figures of A's site rows against B's, both taken by hooks and the tail by hand."""
    from embedlens import lens_text
    from embedlens.analysis.lens.options import SUFFIX

    a, b = tiny("llama-untied"), tiny("llama-tied")
    r = lens_text(a, text, ctx=CTX, against=b, site=EVERY)
    rows_a, out_a, t = site_rows_by_hand(a, "llama-untied", text)
    rows_b, _, _ = site_rows_by_hand(b, "llama-tied", text)
    n, vocab = len(t), 4 + len(WORDS)
    assert r.pair is not None
    inner = [row for row in r.pair if row.site != "resid"]
    assert sorted((row.site, row.layer) for row in inner) == sorted(rows_a)
    for row in inner:
        key = (row.site, row.layer)
        la, lb = log_softmax(rows_a[key]), log_softmax(rows_b[key])
        kl = (np.exp(la) * (la - lb)).sum(-1)
        dp = np.exp(lb[np.arange(n), t]) - np.exp(la[np.arange(n), t])
        same = rows_a[key][:, :vocab].argmax(-1) == rows_b[key][:, :vocab].argmax(-1)
        assert close(row.kl, float(kl.mean()), 1e-4), row
        assert close(row.kl_percentiles["max"], float(kl.max()), 1e-4), row
        assert close(row.dp_mean, float(dp.mean()), 1e-4), row
        assert row.same_top == float(same.mean()), row
        assert close(row.cross_entropy_evaluated, float(-lb[np.arange(n), t].mean())), row
        assert row.residual_kl is None and row.row == f"{row.layer}{SUFFIX[row.site]}", row
    layers = [row for row in r.layers if row.site != "resid"]
    alone = lens_text(a, text, ctx=CTX, site=EVERY)
    assert layers == [row for row in alone.layers if row.site != "resid"]
    assert r.pair_output is not None and out_a.shape[0] == n


def test_against_site_resid_rows_are_the_text_against_run(tiny, cli, text, tmp_path):
    """The resid rows of `--text --against --site` are `--text --against`'s; `--site resid`
    alone is `--text --against` byte for byte."""
    from dataclasses import asdict

    from embedlens import lens_text

    a, b = tiny("llama-untied"), tiny("llama-tied")
    plain = lens_text(a, text, ctx=CTX, against=b, layers="0,2")
    r = lens_text(a, text, ctx=CTX, against=b, layers="0,2", site="mlp_out,resid")
    assert r.pair is not None and plain.pair is not None
    resid = [row for row in r.pair if row.site == "resid"]
    assert [{k: v for k, v in asdict(x).items() if k not in ("site", "row")} for x in resid] == [
        asdict(x) for x in plain.pair
    ]
    assert r.pair_output == plain.pair_output
    for shown in ([], ["--json"]):
        args = ["lens", a, "--text", text, "--ctx", CTX, "--against", b, *shown]
        one = cli(*args)
        site = cli(*args, "--site", "resid")
        assert one.exit_code == site.exit_code == 0, site.stderr
        assert site.stdout == one.stdout
    data = cli.json("lens", a, "--text", text, "--ctx", CTX, "--against", b, "--site", EVERY)
    assert {row["site"] for row in data["pair"]} == set(data["sites"])
    assert all(row["residual_kl"] is None for row in data["pair"] if row["site"] != "resid")
    shown = cli("lens", a, "--text", text, "--ctx", CTX, "--against", b, "--site", "attn_out")
    assert shown.exit_code == 0 and "1.attn" in shown.stdout
    plot = tmp_path / "curves.svg"
    args = ["lens", a, "--text", text, "--ctx", CTX, "--against", b, "--site", "attn_out,resid"]
    drawn = cli(*args, "--plot", plot)
    assert drawn.exit_code == 0, drawn.stderr
    assert plot.read_text(encoding="utf-8").count(">attn_out<") >= 1
