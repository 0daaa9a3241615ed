"""Two comparisons composed from runs that exist, each equal to the runs it is made of.

`--text --tuned --against`: both models read through the same tuned lens (tuned on A); A's rows
are `lens A --text --tuned`'s, B's cross-entropy is `lens B --text --tuned`'s, and the pair's
figures are `--text --against`'s taken by hand through the tuned lens (`TunedLens`, on plain
transformers' hidden states). `--tuned --against-logits` is `--tuned`'s table beside
`--against-logits`' comparison at the output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import embedlens
from tests.test_lens_combine import tuned_pair  # noqa: F401  (the fixture: A, B, A's lens)
from tests.test_lens_text import CTX, windows_by_hand, words_text


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    return words_text(tmp_path_factory.mktemp("text") / "words.txt")


def _by_hand(a: Path, b: Path, lens: Path, text: Path) -> dict[str, list[float]]:
    """Per layer, over the scored tokens: mean KL(A ‖ B), the fraction of equal argmaxes (among
    the tokenizer's tokens), and
    the mean KL(A ‖ A's lens on B's residual), each side's layers through the tuned lens
    (`TunedLens`) on the hidden states transformers gives, the output its logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    real = len(AutoTokenizer.from_pretrained(a))
    ma, mb = (AutoModelForCausalLM.from_pretrained(m).eval() for m in (a, b))
    la, lb = (embedlens.TunedLens.from_folder(m, lens) for m in (ma, mb))
    wins, pos = windows_by_hand(a, text.read_text(), CTX)
    n = ma.config.num_hidden_layers
    sums: dict[str, np.ndarray] = {k: np.zeros(n + 1) for k in ("kl", "same", "res")}
    with torch.no_grad():
        for w in wins:
            ids = torch.tensor([w])
            oa, ob = (m(ids, output_hidden_states=True) for m in (ma, mb))
            for layer in range(n + 1):
                if layer == n:
                    xa, xb, xr = oa.logits[0, pos], ob.logits[0, pos], None
                else:
                    ha, hb = oa.hidden_states[layer][0, pos], ob.hidden_states[layer][0, pos]
                    xa, xb, xr = la(ha, layer), lb(hb, layer), la(hb, layer)
                pa = xa.double().log_softmax(-1)

                def kl(x: Any, pa: Any = pa) -> float:
                    return float((pa.exp() * (pa - x.double().log_softmax(-1))).sum())

                sums["kl"][layer] += kl(xb)
                sums["res"][layer] += kl(xb if xr is None else xr)
                sums["same"][layer] += float(
                    (xa[:, :real].argmax(-1) == xb[:, :real].argmax(-1)).sum()
                )
    scored = len(wins) * len(pos)
    return {k: (v / scored).tolist() for k, v in sums.items()}


def test_text_tuned_against_equals_each_sides_tuned_run(tuned_pair, text):  # noqa: F811
    a, b, lens = tuned_pair
    pair = embedlens.lens_text(a, text, ctx=CTX, tuned=lens, against=b)
    alone_a = embedlens.lens_text(a, text, ctx=CTX, tuned=lens)
    alone_b = embedlens.lens_text(b, text, ctx=CTX, tuned=lens)
    assert pair.lens == "tuned" and pair.pair is not None
    assert pair.layers == alone_a.layers and pair.logit_layers == alone_a.logit_layers
    theirs = [p.cross_entropy_evaluated for p in pair.pair]
    assert theirs == pytest.approx([x.cross_entropy for x in alone_b.layers], rel=1e-9)
    hand = _by_hand(a, b, lens, text)
    assert [p.kl for p in pair.pair] == pytest.approx(hand["kl"], rel=1e-4, abs=1e-7)
    assert [p.residual_kl for p in pair.pair] == pytest.approx(hand["res"], rel=1e-4, abs=1e-7)
    assert [p.same_top for p in pair.pair] == pytest.approx(hand["same"], abs=1e-12)
    # block 1 changed: the two agree through the tuned lens before it, part after it
    assert pair.pair[0].kl == 0 and pair.pair[1].kl == 0 and pair.pair[2].kl > 1e-6
    logit = embedlens.lens_text(a, text, ctx=CTX, against=b)
    assert logit.pair is not None and pair.pair[-1] == logit.pair[-1]  # the output: untranslated


def test_text_tuned_against_on_the_command_line(tuned_pair, text, cli):  # noqa: F811
    a, b, lens = tuned_pair
    args = ("lens", a, "--text", text, "--ctx", CTX, "--tuned", lens, "--against", b)
    data = cli.json(*args)
    assert data["lens"] == "tuned" and len(data["pair"]) == len(data["layers"])
    table = cli(*args)
    assert table.exit_code == 0, table.stderr
    assert "Tuned lens of" in table.stdout and "mean KLD" in table.stdout


def test_text_tuned_against_logits_is_tuned_beside_the_files_comparison(
    tuned_pair,  # noqa: F811
    text,
    tmp_path,
):
    a, b, lens = tuned_pair
    saved = tmp_path / "b.npz"
    embedlens.lens_text(b, text, ctx=CTX, save_logits=saved)
    both = embedlens.lens_text(a, text, ctx=CTX, tuned=lens, against_logits=saved)
    tuned = embedlens.lens_text(a, text, ctx=CTX, tuned=lens)
    plain = embedlens.lens_text(a, text, ctx=CTX, against_logits=saved)
    assert both.layers == tuned.layers and both.logit_layers == tuned.logit_layers
    assert both.pair == plain.pair and both.pair_output == plain.pair_output


PROMPTS = [
    {"prompt": "the king of France is", "target": "Paris"},
    {"prompt": "the capital city of Italy is Rome and the capital of Germany is"},
    {"prompt": "a cat and a dog"},
]
SITES = "attn_out,resid_mid,mlp_out,resid"


@pytest.fixture(scope="module")
def sites_pair(tiny, tmp_path_factory) -> tuple[Path, Path]:
    """(A, B): B is A with its second block's MLP scaled."""
    from safetensors.torch import load_file, save_file

    a = tiny("llama-tied")
    b = tmp_path_factory.mktemp("mlp") / "b"
    b.mkdir()
    for f in a.iterdir():
        (b / f.name).write_bytes(f.read_bytes())
    weights = load_file(b / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"] *= 3
    save_file(weights, b / "model.safetensors", metadata={"format": "pt"})
    return a, b


def _diff_rows(report: Any) -> list[tuple[str, float, bool]]:
    return [(r.row, r.kl, r.top1_agree) for r in report.site_diff]


@pytest.mark.parametrize("apart", [False, True], ids=["together", "apart"])
def test_prompts_against_site_equals_each_prompts_run(sites_pair, monkeypatch, apart):
    """Each line is that prompt's `--against --site` report (its rows inside the blocks the same
    bits; the residual stream's the batch's, float32 rounding apart), on both memory paths; the
    summary's means inside the blocks are the means of the lines', and where the two part is
    read from them as one prompt's report reads it."""
    a, b = sites_pair
    if apart:  # one model at a time: B's rows wait on disk while A runs
        from embedlens.analysis.lens import against

        monkeypatch.setattr(against, "apart_note", lambda _a, _b: "apart")
    each: list[Any] = []
    summary = embedlens.lens_prompts(a, PROMPTS, against=b, site=SITES, top_k=3,
                                     on_report=lambda r, _: each.append(r))  # fmt: skip
    alone = [
        embedlens.lens(a, row["prompt"], target=row.get("target"), against=b, site=SITES, top_k=3)
        for row in PROMPTS
    ]
    for got, one in zip(each, alone, strict=True):
        assert type(got) is type(one)
        assert _diff_rows(got) == _diff_rows(one)
        assert (got.sites, got.parts_at, got.parts_in) == (one.sites, one.parts_at, one.parts_in)
        assert got.block_sums == one.block_sums
        kls = [d.kl for d in got.diff.layers]
        assert kls == pytest.approx([d.kl for d in one.diff.layers], rel=1e-3, abs=1e-9)
    assert summary.sites == SITES.split(",")  # in block order
    assert [r.row for r in summary.site_diff] == [r.row for r in alone[0].site_diff]
    for i, row in enumerate(summary.site_diff):
        mean = sum(r.site_diff[i].kl for r in each) / len(each)
        agree = sum(r.site_diff[i].top1_agree for r in each) / len(each)
        assert row.kl == pytest.approx(mean, rel=1e-12, abs=1e-300)
        assert row.top1_agreement == pytest.approx(agree, rel=1e-12)
    first = next(r for r in summary.site_diff if r.kl > summary.diff.threshold)
    assert (summary.parts_at, summary.parts_in) == (first.row, "the MLP of block 2")
    assert first.row == "2.mlp" and all(r.kl == 0 for r in summary.site_diff if r.layer == 1)
    assert summary.block_sums is not None and summary.block_sums.max_abs_error <= max(
        r.block_sums.max_abs_error for r in each
    )


def test_prompts_against_site_over_every_position(sites_pair):
    """With --position all, the means are over every (prompt, position): each prompt's own
    positions compared as one prompt's report compares the position it reads."""
    a, b = sites_pair
    prompt = PROMPTS[0]["prompt"]
    summary = embedlens.lens_prompts(a, [prompt], against=b, site="mlp_out", position="all")
    n = summary.n_positions
    assert n > 1 and summary.sites == ["mlp_out"]
    per = [
        embedlens.lens(a, prompt, against=b, site="mlp_out", position=p).site_diff for p in range(n)
    ]
    for i, row in enumerate(summary.site_diff):
        assert row.kl == pytest.approx(sum(x[i].kl for x in per) / n, rel=1e-4, abs=1e-9)
        assert row.top1_agreement == pytest.approx(sum(x[i].top1_agree for x in per) / n)


def test_prompts_against_site_resid_is_prompts_against(sites_pair, cli, tmp_path):
    """`--site resid` is the residual stream alone: the same bytes as without --site."""
    a, b = sites_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS), "utf-8")
    plain = cli("lens", a, "--prompts", prompts, "--against", b, "--json")
    resid = cli("lens", a, "--prompts", prompts, "--against", b, "--site", "resid", "--json")
    assert plain.exit_code == 0 and resid.exit_code == 0, (plain.stderr, resid.stderr)
    assert resid.stdout == plain.stdout


def test_prompts_against_site_on_the_command_line(sites_pair, cli, tmp_path):
    a, b = sites_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS), "utf-8")
    args = ("lens", a, "--prompts", prompts, "--against", b, "--site", "resid_mid,resid")
    lines = [json.loads(x) for x in cli(*args, "--json").stdout.splitlines()]
    assert [x["parts_at"] for x in lines[:-1]] == ["2"] * len(PROMPTS)
    summary = lines[-1]
    assert summary["parts_at"] == "2" and summary["parts_in"] == "the MLP of block 2"
    assert summary["diff"]["first_divergent_layer"] == 2
    table = cli(*args)
    assert table.exit_code == 0, table.stderr
    assert "Inside the blocks" in table.stdout and "over 3 prompts" in table.stdout
    assert "first part at row 2: the MLP of block 2" in table.stdout


def test_text_tuned_against_a_b_of_another_width_is_refused_before_its_weights(
    tuned_pair,  # noqa: F811
    text,
    cli,
    tmp_path,
):
    """B shares A's vocabulary and layers, but not its width: it is refused from its config,
    with the two sizes, before B's weights are read (they are not there): the pair's own check
    comes first (A's decoder cannot read B's stream), before the lens (A's) is checked for it."""
    import shutil

    from transformers import AutoConfig

    a, _, lens = tuned_pair
    config = AutoConfig.from_pretrained(a)
    config.hidden_size *= 2
    wide = tmp_path / "wide"
    config.save_pretrained(wide)
    for f in a.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, wide / f.name)
    said = cli.fails("lens", a, "--text", text, "--ctx", CTX, "--tuned", lens, "--against", wide,
                     code=1)  # fmt: skip
    assert f"has a hidden size of {config.hidden_size}" in said
