"""The states source composed with sites and with a comparison, each equal to the runs it is
composed from.

- `--save-states --site S` saves the sites asked for, and `--states FILE --site S` decodes them
  to the model run's site rows (`lens PROMPT --site S`), on one prompt and on `--prompts`;
  `--site resid` is plain `--states`, byte for byte; a site the file lacks is refused.
- `lens A --states FILE --against B` (and `--site`) is `lens A PROMPT --against B` where FILE
  holds A's states of PROMPT: A's rows are decoded from the same bits through the same tail in
  the same chunks, B runs on the same ids, and every figure is the same bits, but A's output
  row at a position other than the last, which the file holds as the decoding of block L's
  output (it keeps the model's own logits at the last position alone): float32 rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import models
from tests.test_lens_combine import _changed
from tests.test_states import _close_figures, _same_figures, vllm_file
from tests.test_tune import words_file

PROMPT = "the king of France is"
SITES = "attn_out,resid_mid,mlp_out,resid"


def _sites_of(family: str) -> str:
    """Every site the family's blocks have (a parallel block has no resid_mid)."""
    return "attn_out,mlp_out,resid" if family in ("gpt-neox", "phi") else SITES


@pytest.mark.parametrize("family", ["llama-tied", "gpt-neox", "gemma2", "gpt2"])
@pytest.mark.parametrize("position", ["-1", "all"])
def test_saved_sites_decode_to_the_model_runs_site_rows(family, position, tiny, cli, tmp_path):
    folder, saved = tiny(family), tmp_path / "s.safetensors"
    inner = _sites_of(family).removesuffix(",resid")  # the last layer's own row aside
    args = ["--site", inner, "--position", position, "--target", "king", "-k", "3"]
    direct = cli.json("lens", folder, PROMPT, *args, "--save-states", saved)
    decoded = cli.json("lens", folder, "--states", saved, *args)
    _same_figures(direct, decoded)
    assert decoded["sites"] == inner.split(",") and decoded["block_sums"] == direct["block_sums"]
    assert decoded["states"]["checked"] is True
    assert decoded["states"]["metadata"]["sites"] == inner


def test_each_site_alone_and_the_default_site(tiny, cli, tmp_path):
    """A file saved with every site decodes each one alone, and several, as the model run does;
    `--site resid` is plain `--states`, byte for byte, on it and on a file without sites."""
    folder, saved, plain = (
        tiny("llama-tied"),
        tmp_path / "s.safetensors",
        tmp_path / "p.safetensors",
    )
    cli.json("lens", folder, PROMPT, "--site", SITES, "--save-states", saved)
    cli.json("lens", folder, PROMPT, "--save-states", plain)
    for site in ("attn_out", "resid_mid", "mlp_out", "attn_out,resid", "mlp_out,resid_mid"):
        args = ["--site", site, "-k", "4", "--layers", "1:4"]
        _same_figures(cli.json("lens", folder, PROMPT, *args),
                      cli.json("lens", folder, "--states", saved, *args))  # fmt: skip
    table = cli("lens", folder, "--states", saved, "--site", "attn_out,resid")
    assert table.exit_code == 0 and "3.attn" in table.stdout and "self-check made" in table.stdout
    for file in (saved, plain):
        alone = cli("lens", folder, "--states", file, "--json")
        resid = cli("lens", folder, "--states", file, "--site", "resid", "--json")
        assert alone.exit_code == resid.exit_code == 0 and alone.stdout == resid.stdout


def test_saving_attn_out_keeps_resid_mid_for_its_change(tiny, tmp_path):
    """attn_out of a sequential block is saved with resid_mid (its change is read against it);
    a parallel block has none; the states' dtype keeps what it holds exactly."""
    from safetensors import safe_open

    import embedlens

    for family, held in (("llama-tied", {"attn_out", "resid_mid"}), ("gpt-neox", {"attn_out"})):
        saved = tmp_path / f"{family}.safetensors"
        embedlens.lens(tiny(family), PROMPT, site="attn_out", save_states=saved)
        with safe_open(str(saved), "pt") as f:
            assert set(f.keys()) == {"token_ids", "hidden_states", "logits", *held}
            states = f.get_tensor("hidden_states")
            for site in held:
                t = f.get_tensor(site)
                assert t.dtype == states.dtype and t.shape[1] == states.shape[1] - 1
            assert f.metadata()["sites"].split(",") == [s for s in SITES.split(",") if s in held]
        report = embedlens.lens_states(tiny(family), saved, site="attn_out")
        assert [row.row for row in report.layers] == ["1.attn", "2.attn", "3.attn"]


def test_a_site_the_file_does_not_hold_is_refused_naming_those_it_holds(tiny, cli, tmp_path):
    folder = tiny("llama-tied")
    saved, plain, vllm = (tmp_path / f"{n}.safetensors" for n in ("s", "p", "v"))
    cli.json("lens", folder, PROMPT, "--site", "mlp_out", "--save-states", saved)
    cli.json("lens", folder, PROMPT, "--save-states", plain)
    vllm_file(folder, vllm, PROMPT, [1, 2, 3])
    said = cli.fails("lens", folder, "--states", saved, "--site", "attn_out", code=2)
    assert "does not hold --site attn_out: it holds resid, resid_mid, mlp_out" in said
    said = cli.fails("lens", folder, "--states", plain, "--site", "resid,mlp_out", code=2)
    assert "does not hold --site mlp_out: it holds resid\n" in said
    said = cli.fails("lens", folder, "--states", vllm, "--state-layers", "1:4", "--site",
                     "resid_mid", code=2)  # fmt: skip
    assert "does not hold --site resid_mid: it holds resid\n" in said


def test_a_file_whose_sites_do_not_match_its_metadata_is_refused(tiny, cli, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, saved = tiny("llama-tied"), tmp_path / "s.safetensors"
    cli.json("lens", folder, PROMPT, "--site", "mlp_out", "--save-states", saved)
    from safetensors import safe_open

    with safe_open(str(saved), "pt") as f:
        meta = f.metadata()
    tensors = load_file(saved)
    tensors["mlp_out"] = tensors["mlp_out"][:, :2].contiguous()
    save_file(tensors, tmp_path / "cut.safetensors", metadata=meta)
    said = cli.fails("lens", folder, "--states", tmp_path / "cut.safetensors", code=1)
    assert "names the site mlp_out, but the file holds F32 [5, 2, 32]" in said
    del tensors["mlp_out"]
    save_file(tensors, tmp_path / "none.safetensors", metadata=meta)
    said = cli.fails("lens", folder, "--states", tmp_path / "none.safetensors", code=1)
    assert "names the site mlp_out, but the file lacks it" in said


def test_prompts_save_each_prompts_sites(tiny, cli, tmp_path):
    """`--prompts --site --save-states DIR`: each prompt's file decodes to that prompt's run."""
    folder, out = tiny("gemma2"), tmp_path / "many"
    lines = [PROMPT, "the capital city of Italy is Rome and the capital of Germany is"]
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(lines) + "\n")
    ran = cli("lens", folder, "--prompts", prompts, "--site", "attn_out,mlp_out",
              "--save-states", out, "-q")  # fmt: skip
    assert ran.exit_code == 0, ran.stderr
    args = ["--site", "mlp_out,attn_out", "-k", "2"]
    for line, prompt in enumerate(lines, start=1):
        saved = out / f"{line:06d}.safetensors"
        _same_figures(cli.json("lens", folder, prompt, *args),
                      cli.json("lens", folder, "--states", saved, *args))  # fmt: skip


@pytest.fixture(scope="module")
def pair(tiny, tmp_path_factory) -> tuple[Path, Path, Path]:
    """(A, B: A with block 1 changed, A's states of PROMPT)."""
    import embedlens

    root = tmp_path_factory.mktemp("states-pair")
    a = tiny("llama-untied")
    saved = root / "a.safetensors"
    embedlens.lens(a, PROMPT, save_states=saved)
    return a, _changed(a, root / "b"), saved


@pytest.mark.parametrize("args", [[], ["--target", "Paris", "-k", "3", "--layers", "1,3"],
                                  ["--threshold", "0.5", "--position", "2"],
                                  ["--site", "resid_mid,mlp_out", "--layers", "2:4"]])  # fmt: skip
def test_states_against_equals_the_model_run_against(pair, cli, args, tmp_path):
    a, b, saved = pair
    if "--site" in args:  # where inside the blocks the two part: a file with A's sites
        saved = tmp_path / "sites.safetensors"
        cli.json("lens", a, PROMPT, "--site", SITES, "--save-states", saved)
    direct = cli.json("lens", a, PROMPT, "--against", b, *args)
    decoded = cli.json("lens", a, "--states", saved, "--against", b, *args)
    if "--position" in args:  # the file holds A's own logits at the last position alone: at
        # another, A's output row is the decoding of block L's output (within float32 rounding)
        _close_figures(direct, decoded)
    else:
        _same_figures(direct, decoded)  # every KL, top-k and B's check: the same bits
    assert decoded["diff"]["first_divergent_layer"] == direct["diff"]["first_divergent_layer"]
    assert ("site_diff" in decoded) == ("--site" in args)
    assert decoded["states"]["checked"] is True
    table = cli("lens", a, "--states", saved, "--against", b, *args)
    assert table.exit_code == 0 and "against" in table.stdout, table.stderr


def test_states_against_from_python_equals_lens_against(pair):
    import embedlens

    a, b, saved = pair
    direct = embedlens.lens(a, PROMPT, against=b, top_k=2)
    decoded = embedlens.lens_states(a, saved, against=b, top_k=2)
    assert decoded.diff == direct.diff and decoded.layers == direct.layers


def test_a_b_that_does_not_fit_is_refused_with_one_line(pair, tiny, cli, tmp_path, monkeypatch):
    """B of another hidden size (the --against check, which the model run gives too), or of
    another vocabulary."""
    a, b, saved = pair
    wide = {**models.FAMILIES["llama-untied"], "hidden_size": 48}
    monkeypatch.setitem(models.FAMILIES, "llama-wide", wide)
    other = models.build("llama-wide", tmp_path / "wide")
    for run in ((a, "--states", saved), (a, PROMPT)):
        said = cli.fails("lens", *run, "--against", other, code=1)
        assert "has a hidden size of 48" in said
    tokens = json.loads((b / "tokenizer.json").read_text())
    vocab = tokens["model"]["vocab"]
    vocab["Paris"], vocab["king"] = vocab["king"], vocab["Paris"]
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    for f in b.iterdir():
        (swapped / f.name).write_bytes(f.read_bytes())
    (swapped / "tokenizer.json").write_text(json.dumps(tokens))
    said = cli.fails("lens", a, "--states", saved, "--against", swapped, code=1)
    assert "does not share the vocabulary" in said


def test_states_against_through_a_tuned_lens_equals_the_model_run(pair, cli, tmp_path):
    """`--tuned` with `--states --against`: both sides read through the lens (tuned on A), as
    `lens A PROMPT --tuned DIR --against B` reads them."""
    import embedlens

    a, b, saved = pair
    lens = tmp_path / "lens"
    embedlens.tune(a, words_file(tmp_path / "w.txt"), lens, tokens=512, eval_tokens=128, steps=1)
    args = ["--tuned", lens, "--against", b, "--target", "Paris", "-k", "3"]
    direct = cli.json("lens", a, PROMPT, *args)
    decoded = cli.json("lens", a, "--states", saved, *args)
    _same_figures(direct, decoded)
    assert decoded["tuned"] == direct["tuned"] and decoded["diff"]["first_divergent_layer"] == 2


def test_a_vllm_file_against_b_says_the_check_was_not_made(pair, cli, tmp_path):
    """vLLM's file holds no logits: A's check is null and the table says why, B's is made."""
    a, b, _ = pair
    vllm = tmp_path / "v.safetensors"
    vllm_file(a, vllm, PROMPT, [0, 1, 2])
    args = ["--states", vllm, "--state-layers", "0:3", "--against", b]
    out = cli.json("lens", a, *args)
    assert out["check"] is None and out["diff"]["against_check"]["ok"] is True
    assert [row["layer"] for row in out["diff"]["layers"]] == [0, 1, 2]
    table = cli("lens", a, *args)
    assert table.exit_code == 0 and "self-check not made" in table.stdout
    assert "A does NOT" not in table.stdout and "B reproduces its logits" in table.stdout
