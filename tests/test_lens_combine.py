"""Combinations of the lens's parts that run, each equal to the runs it is composed from.

`--tuned --against` on a prompt: A's rows are `lens A --tuned`'s, B's rows (`against_top`) are
`lens B --tuned`'s with the same lens (B is A with one block changed, so the lens tuned on A is
B's size), and each KL is the two sides' rows compared as `--against` compares them; over
`--prompts`, each line is that prompt's run.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import embedlens
from tests.test_tune import words_file

PROMPT = "the king of France is"


def _changed(a: Path, folder: Path) -> Path:
    """A copy of `a` with noise added to block 1's matrices (its final norm and head kept)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(a, folder)
    weights = load_file(folder / "model.safetensors")
    noise = torch.Generator().manual_seed(1)
    pattern = re.compile(r"\.(layers|h)\.1\.")
    for name in [n for n in weights if pattern.search(n) and weights[n].ndim == 2]:
        weights[name] = weights[name] + 0.5 * torch.randn(weights[name].shape, generator=noise)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def tuned_pair(tiny, tmp_path_factory) -> tuple[Path, Path, Path]:
    """(A, B, a lens tuned on A)."""
    root = tmp_path_factory.mktemp("tuned-pair")
    a = tiny("llama-untied")
    lens = root / "lens"
    embedlens.tune(a, words_file(root / "w.txt"), lens, tokens=512, eval_tokens=128, steps=1)
    return a, _changed(a, root / "b"), lens


def _rows(report: Any) -> list[list[tuple[int, float]]]:
    return [[(t.id, t.prob) for t in row.top] for row in report.layers]


def test_tuned_against_equals_each_sides_tuned_run(tuned_pair):
    a, b, lens = tuned_pair
    pair = embedlens.lens(a, PROMPT, tuned=lens, against=b, target="Paris", top_k=3)
    alone_a = embedlens.lens(a, PROMPT, tuned=lens, target="Paris", top_k=3)
    alone_b = embedlens.lens(b, PROMPT, tuned=lens, target="Paris", top_k=3)
    assert pair.tuned == alone_a.tuned
    assert _rows(pair) == _rows(alone_a)
    theirs = [[(t.id, t.prob) for t in row.against_top] for row in pair.diff.layers]
    assert theirs == _rows(alone_b)
    for mine, other, d in zip(alone_a.layers, alone_b.layers, pair.diff.layers, strict=True):
        assert mine.target is not None and other.target is not None
        delta = other.target.logprob - mine.target.logprob
        assert d.target_logprob_delta == pytest.approx(delta, abs=1e-6)
        assert d.top1_agree == (mine.top[0].id == other.top[0].id)
    # the tuned lens parts the two where the logit lens does, no earlier: block 1's output
    assert pair.diff.first_divergent_layer == 2
    logit = embedlens.lens(a, PROMPT, against=b, target="Paris", top_k=3)
    assert [d.kl for d in pair.diff.layers] != [d.kl for d in logit.diff.layers]
    assert pair.diff.layers[-1].kl == logit.diff.layers[-1].kl  # the output: no translator


def test_tuned_against_on_the_command_line(tuned_pair, cli):
    a, b, lens = tuned_pair
    out = cli.json("lens", a, PROMPT, "--tuned", lens, "--against", b)
    assert out["tuned"]["path"] == str(lens)
    assert out["diff"]["first_divergent_layer"] == 2
    table = cli("lens", a, PROMPT, "--tuned", lens, "--against", b, "-q")
    assert table.exit_code == 0, table.stderr
    assert "Tuned lens of" in table.stdout and "read through the tuned lens" in table.stdout


PROMPTS = [
    {"prompt": PROMPT, "target": "Paris"},
    {"prompt": "the capital city of Italy is Rome and the capital of Germany is"},
]


@pytest.mark.parametrize("apart", [False, True], ids=["together", "apart"])
def test_tuned_against_over_prompts_equals_each_prompts_run(tuned_pair, monkeypatch, apart):
    """Each line is that prompt's `--tuned --against` report (the batch's rows: float32
    rounding apart), on both memory paths; the summary's means are the means of the lines."""
    a, b, lens = tuned_pair
    if apart:  # one model at a time: B's rows wait on disk while A runs
        from embedlens.analysis.lens import against

        monkeypatch.setattr(against, "apart_note", lambda _a, _b: "apart")
    each: list[Any] = []
    summary = embedlens.lens_prompts(a, PROMPTS, tuned=lens, against=b, top_k=3,
                                     on_report=lambda r, _: each.append(r))  # fmt: skip
    assert summary.tuned is not None and summary.tuned.path == str(lens)
    for row, got in zip(PROMPTS, each, strict=True):
        alone = embedlens.lens(a, row["prompt"], target=row.get("target"), tuned=lens,
                               against=b, top_k=3)  # fmt: skip
        assert type(got) is type(alone)
        assert got.tuned == alone.tuned
        assert [[t.id for t in r.top] for r in got.layers] == [
            [t.id for t in r.top] for r in alone.layers
        ]
        kls = [d.kl for d in got.diff.layers]
        assert kls == pytest.approx([d.kl for d in alone.diff.layers], rel=1e-3, abs=1e-9)
    for i, row in enumerate(summary.diff.layers):
        mean = sum(r.diff.layers[i].kl for r in each) / len(each)
        assert row.kl == pytest.approx(mean, rel=1e-12)


def test_compare_logit_with_against_is_refused_with_its_reason(tuned_pair, cli, tmp_path):
    a, b, lens = tuned_pair
    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPT + "\n")
    said = cli.fails("lens", a, "--prompts", prompts, "--tuned", lens, "--against", b,
                     "--compare-logit", code=2)  # fmt: skip
    assert "without --against" in said


def test_save_states_with_sites_saves_them_and_states_reads_them_back(tiny, cli, tmp_path):
    """It used to exit 0 having saved the residual stream alone (then it was refused): the file
    now holds the sites asked for, and `--states --site` reads them back as the run gave them
    (tests/test_combine_states.py holds the rest)."""
    out = tmp_path / "s.safetensors"
    args = ["--site", "attn_out", "-k", "3"]
    ran = cli.json("lens", tiny("llama-tied"), PROMPT, *args, "--save-states", out)
    read = cli.json("lens", tiny("llama-tied"), "--states", out, *args)
    assert read["layers"] == ran["layers"] and read["states"]["metadata"]["sites"] == (
        "attn_out,resid_mid"
    )
    folder = tmp_path / "many"
    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPT + "\n")
    saved = cli("lens", tiny("llama-tied"), "--prompts", prompts, "--site", "mlp_out",
                "--save-states", folder, "-q")  # fmt: skip
    assert saved.exit_code == 0, saved.stderr
    read = cli.json("lens", tiny("llama-tied"), "--states", folder / "000001.safetensors",
                    "--site", "mlp_out")  # fmt: skip
    assert [row["row"] for row in read["layers"]] == ["1.mlp", "2.mlp", "3.mlp"]
