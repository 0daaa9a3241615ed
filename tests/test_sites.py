"""`lens --site`: inside the blocks, on every tiny family and on SmolLM2.

The references are plain transformers with forward hooks written here, each family's modules
named by hand (embedlens finds them from the sums alone): the block's input, the attention's
piece, the MLP's piece and the block's output; resid_mid is input + attention. The lens's rows
are checked against the hand-written tail of tests/test_lens.py on those references.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models import FAMILIES, TOKENIZER_LEN
from tests.test_lens import PROMPT, _ids, _load, reference_tail

PARALLEL = {"gpt-neox", "phi", "cohere"}
PIECES = {  # each family's pieces, as its modeling code adds them (None: refused)
    "gpt2": ("attn", "mlp"),
    "gpt-neox": ("attention", "mlp"),
    "gemma2": ("post_attention_layernorm", "post_feedforward_layernorm"),
    "opt": None,  # post-norm blocks: a norm after each add
}
EVERY = "attn_out,resid_mid,mlp_out,resid"


def reference_pieces(model: Any, family: str, ids: list[int]) -> list[dict[str, torch.Tensor]]:
    """Each block's input, attention piece, MLP piece and output [T, d], by forward hooks."""
    from embedlens.analysis.lens.blocks import find_blocks

    attn_name, mlp_name = PIECES.get(family) or ("self_attn", "mlp")
    seen: list[dict[str, torch.Tensor]] = []
    handles = []

    def keep(name: str) -> Any:
        def hook(_m: Any, _args: Any, out: Any) -> None:
            seen[-1][name] = (out[0] if isinstance(out, tuple) else out)[0].detach()

        return hook

    def enter(_m: Any, args: Any, kwargs: Any) -> None:
        seen.append({"pre": (args[0] if args else kwargs["hidden_states"])[0].detach()})

    for block in find_blocks(model).modules:
        handles.append(block.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(block.get_submodule(attn_name).register_forward_hook(keep("attn")))
        handles.append(block.get_submodule(mlp_name).register_forward_hook(keep("mlp")))
        handles.append(block.register_forward_hook(keep("post")))
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return seen


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "opt"])
def test_sums_hold_and_pieces_equal_hooks(tiny, family):
    from embedlens.analysis.lens.blocks import find_blocks
    from embedlens.analysis.lens.sites import capture_pieces

    folder = tiny(family)
    model, ids = _load(folder), _ids(folder)
    ref = reference_pieces(model, family, ids)
    every = list(range(len(ids)))
    pieces = capture_pieces(model, find_blocks(model), ids, every)
    for layer, r in enumerate(ref, start=1):
        split = pieces.splits[layer]
        assert split.parallel == (family in PARALLEL), layer
        assert split.error <= split.tolerance < 1e-4, (layer, split)
        assert torch.equal(pieces.pre[layer], r["pre"].float())
        assert torch.equal(pieces.attn[layer], r["attn"].float()), layer
        assert torch.equal(pieces.mlp[layer], r["mlp"].float()), layer
        assert torch.equal(pieces.post[layer], r["post"].float())
        if family in PARALLEL:
            total = r["pre"] + r["attn"] + r["mlp"]
            assert (total - r["post"]).abs().max() <= split.tolerance
            assert layer not in pieces.mid
        else:
            assert torch.equal(pieces.mid[layer], r["pre"] + r["attn"]), layer
            assert torch.equal(r["pre"] + r["attn"] + r["mlp"], r["post"]), layer


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "opt"])
def test_every_site_decodes_as_the_hand_written_tail(tiny, cli, family):
    """Each row of --site through the model's tail as tests/test_lens.py writes it by hand: a
    sequential block's resid_mid, each piece alone (direct), and each piece's change."""
    folder = tiny(family)
    model, ids = _load(folder), _ids(folder)
    ref = reference_pieces(model, family, ids)
    sites = "attn_out,mlp_out,resid" if family in PARALLEL else EVERY
    data = cli.json("lens", folder, PROMPT, "--site", sites, "-k", "3")
    plain = cli.json("lens", folder, PROMPT, "-k", "3")
    rows = {row["row"]: row for row in data["layers"]}
    for row in plain["layers"]:  # the residual stream's rows are the plain lens's
        assert {k: v for k, v in rows[str(row["layer"])].items() if k in row} == row

    def probs(h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return reference_tail(model, family, h[-1]).float().log_softmax(-1)

    for layer, r in enumerate(ref, start=1):
        mid = r["pre"] + r["attn"]
        before_mlp = r["pre"] if family in PARALLEL else mid
        after_mlp = r["pre"] + r["mlp"] if family in PARALLEL else r["post"]
        checks = [("attn", r["attn"], (r["pre"], mid)), ("mlp", r["mlp"], (before_mlp, after_mlp))]
        if family not in PARALLEL:
            checks.append(("mid", mid, None))
        for suffix, h, change in checks:
            row = rows[f"{layer}.{suffix}"]
            lp = probs(h)
            assert [t["id"] for t in row["top"]] == lp[:TOKENIZER_LEN].topk(3).indices.tolist()
            for t in row["top"]:
                assert t["logprob"] == pytest.approx(float(lp[t["id"]]), abs=1e-4), (layer, suffix)
            if change is None:
                assert row["change"] is None and row["decoded"] == "lens"
                continue
            assert row["decoded"] == "direct"
            lb, la = probs(change[0]).double(), probs(change[1]).double()
            kl = float((la.exp() * (la - lb)).sum())
            assert row["change"]["kl"] == pytest.approx(kl, abs=1e-5), (layer, suffix)
            gained = row["change"]["gained"][0]
            assert gained["delta_logprob"] == pytest.approx(
                float((la - lb)[:TOKENIZER_LEN].max()), abs=1e-4
            )


def test_rows_interleave_in_block_order(tiny, cli):
    data = cli.json(
        "lens", tiny("llama-tied"), PROMPT, "--site", "resid,mlp_out,resid_mid,attn_out"
    )
    labels = [row["row"] for row in data["layers"]]
    assert labels == ["0", "1.attn", "1.mid", "1.mlp", "1", "2.attn", "2.mid", "2.mlp", "2",
                      "3.attn", "3.mid", "3.mlp", "3"]  # fmt: skip
    assert [row["site"] for row in data["layers"][:5]] == [
        "resid", "attn_out", "resid_mid", "mlp_out", "resid"]  # fmt: skip
    assert data["sites"] == ["attn_out", "resid_mid", "mlp_out", "resid"]
    sums = data["block_sums"]
    assert sums["structure"] == "sequential" and (sums["attn"], sums["mlp"]) == ("self_attn", "mlp")
    assert sums["max_abs_error"] <= sums["tolerance"]
    only = cli.json("lens", tiny("llama-tied"), PROMPT, "--site", "resid_mid", "--layers", "2:")
    assert [row["row"] for row in only["layers"]] == ["2.mid", "3.mid"]


def test_site_resid_is_byte_identical(tiny, cli):
    import embedlens

    folder = tiny("llama-tied")
    for extra in ([], ["--position", "all", "--target", "queen"]):
        plain = cli(*["lens", folder, PROMPT, "--json", *extra])
        resid = cli(*["lens", folder, PROMPT, "--json", "--site", "resid", *extra])
        assert plain.exit_code == resid.exit_code == 0
        assert resid.stdout == plain.stdout and "site" not in plain.stdout
        if not extra:
            api = embedlens.lens(folder, PROMPT, site="resid").to_json()
            assert api == embedlens.lens(folder, PROMPT).to_json() == plain.stdout.strip()


@pytest.mark.parametrize("family", sorted(PARALLEL))
def test_resid_mid_of_a_parallel_block_is_refused(tiny, cli, family):
    err = cli.fails("lens", tiny(family), PROMPT, "--site", "resid_mid,resid", code=1)
    assert "resid_mid does not exist in block 1" in err and "in parallel" in err


def test_a_norm_after_the_add_is_refused(tiny, cli):
    err = cli.fails("lens", tiny("opt"), PROMPT, "--site", "attn_out", code=1)
    assert "block 1 (OPTDecoderLayer): its pieces do not add up" in err
    assert "self_attn_layer_norm" in err and "misses its output by" in err


def test_a_scaled_residual_is_refused(tiny):
    """A block whose output is 1.25 x its input + attention + MLP: never decoded wrongly."""
    import embedlens
    from embedlens.analysis.lens.blocks import find_blocks
    from embedlens.errors import UnsupportedError

    folder = tiny("llama-tied")
    model = _load(folder)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    block = find_blocks(model).modules[1]

    def scale(_m: Any, args: Any, kwargs: Any, out: Any) -> Any:
        x = args[0] if args else kwargs["hidden_states"]
        return (out[0] if isinstance(out, tuple) else out) + 0.25 * x

    handle = block.register_forward_hook(scale, with_kwargs=True)
    try:
        assert embedlens.lens(model, PROMPT, tokenizer=tok).check.ok  # resid still reads
        with pytest.raises(UnsupportedError, match=r"block 2 .* do not add up") as e:
            embedlens.lens(model, PROMPT, tokenizer=tok, site="mlp_out")
        assert "plus mlp's output misses its output by" in str(e.value)
    finally:
        handle.remove()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--site", "attn"], "unknown --site attn"),
        (["--site", ","], "unknown --site"),
        (["--site", "resid_mid", "--tuned", "."], "--tuned reads the residual stream only"),
    ],
)
def test_bad_sites(tiny, cli, args, message):
    assert message in cli.fails("lens", tiny("llama-tied"), PROMPT, *args, code=2)


def test_prompts_statistics_per_site(tiny, cli, tmp_path):
    folder = tiny("llama-tied")
    lines = tmp_path / "p.jsonl"
    lines.write_text('{"prompt": "the king of", "target": "France"}\n{"prompt": "a cat"}\n')
    plain = cli("lens", folder, "--prompts", lines, "--json")
    sites = cli("lens", folder, "--prompts", lines, "--json", "--site", "resid_mid,mlp_out,resid")
    assert plain.exit_code == sites.exit_code == 0
    one, many = json.loads(plain.stdout.splitlines()[-1]), json.loads(sites.stdout.splitlines()[-1])
    rows = {row["row"]: row for row in many["layers"]}
    for row in one["layers"]:
        assert {k: v for k, v in rows[str(row["layer"])].items() if k in row} == row
    assert [r["row"] for r in many["layers"]][:4] == ["0", "1.mid", "1.mlp", "1"]
    assert rows["1.mlp"]["change_kl"] >= 0 and rows["1.mid"]["change_kl"] is None
    assert rows["2.mid"]["target_rank_median"] is not None
    # each prompt's line is what the prompt gives alone
    alone = cli.json("lens", folder, "the king of", "--target", "France", "--site",
                     "resid_mid,mlp_out,resid")  # fmt: skip
    first = json.loads(sites.stdout.splitlines()[0])
    assert first["block_sums"] == alone["block_sums"]
    assert [r["row"] for r in first["layers"]] == [r["row"] for r in alone["layers"]]
    for mine, single in zip(first["layers"], alone["layers"], strict=True):
        if mine["site"] != "resid":  # a batch's resid rows round their logprobs in float32
            assert mine == single
        assert [t["id"] for t in mine["top"]] == [t["id"] for t in single["top"]]
    table = cli("lens", folder, "--prompts", lines, "--site", "mlp_out,resid")
    assert table.exit_code == 0 and "1.mlp" in table.stdout and "change KL" in table.stdout


@pytest.mark.slow
def test_prompts_over_two_processes_give_the_statistics_of_one(tiny, cli, tmp_path):
    from tests.test_dist import prompts_file, relative, torchrun

    args = ["lens", tiny("llama-tied"), "--prompts", prompts_file(tmp_path / "p.jsonl"),
            "--json", "--skip-bad", "--site", "attn_out,resid_mid,resid"]  # fmt: skip
    one, two = cli(*args), torchrun(*args)
    assert one.exit_code == 0 and two.returncode == 0, two.stderr
    assert two.stdout.splitlines()[:-1] == one.stdout.splitlines()[:-1]
    a, b = json.loads(one.stdout.splitlines()[-1]), json.loads(two.stdout.splitlines()[-1])
    assert a["block_sums"] == b["block_sums"]
    for row_a, row_b in zip(a["layers"], b["layers"], strict=True):
        assert row_a["row"] == row_b["row"]
        for key in ("kl", "entropy", "top1_agreement", "target_prob", "change_kl"):
            if row_a[key] is None:
                assert row_b[key] is None
            else:
                assert relative(row_a[key], row_b[key]) <= 1e-6, (row_a, row_b)


def test_against_says_which_half_parts(tiny, cli, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tiny("llama-tied")
    other = tmp_path / "b"
    other.mkdir()
    for f in folder.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    weights = load_file(other / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"] *= 3  # block 2's MLP
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    data = cli.json("lens", folder, PROMPT, "--against", other, "--site", "resid_mid,resid")
    assert data["parts_at"] == "2" and data["parts_in"] == "the MLP of block 2"
    kl = {row["row"]: row["kl"] for row in data["site_diff"]}
    assert kl["1.mid"] == kl["1"] == kl["2.mid"] == 0 and kl["2"] > 1e-6
    same = cli.json("lens", folder, PROMPT, "--against", folder, "--site", "attn_out")
    assert same["parts_at"] is None and all(r["kl"] == 0 for r in same["site_diff"])
    (tmp_path / "p.txt").write_text("a cat\n")
    many = cli("lens", folder, "--prompts", tmp_path / "p.txt", "--against", other, "--site",
               "resid_mid", "--json")  # fmt: skip
    line, summary = (json.loads(x) for x in many.stdout.splitlines())
    kl = {row["row"]: row["kl"] for row in summary["site_diff"]}
    assert kl["1.mid"] == kl["2.mid"] == 0 and kl == {r["row"]: r["kl"] for r in line["site_diff"]}


def test_plot_and_table(tiny, cli, tmp_path):
    pytest.importorskip("matplotlib")
    folder = tiny("gemma2")
    out = cli("lens", folder, PROMPT, "--site", "attn_out,resid_mid,resid", "--plot",
              tmp_path / "h.png", "--target", "queen")  # fmt: skip
    assert out.exit_code == 0, out.stderr
    assert (tmp_path / "h.png").stat().st_size > 0
    assert "3.attn" in out.stdout and "post_attention_layernorm's output" in out.stdout
    assert "pieces add up in every block" in out.stdout


@pytest.fixture(scope="module")
def smollm2_plain(smollm2: Path) -> tuple[Any, Any]:
    """SmolLM2 loaded the plain transformers way, float32 (as tests/test_lens.py loads it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from embedlens.compat.transformers.gguf_patches import sharing_gguf_reads

    where, name = str(smollm2.parent), str(smollm2)
    with sharing_gguf_reads():
        tok = AutoTokenizer.from_pretrained(where, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    return model.eval(), tok


def test_smollm2_sums_and_pieces_as_plain_transformers(smollm2, smollm2_plain, cli):
    """SmolLM2: the sums hold in every block, resid_mid and the pieces are the hooks', and the
    decoded rows are the plain tail's."""
    from embedlens.analysis.lens.blocks import find_blocks
    from embedlens.analysis.lens.sites import capture_pieces

    model, tok = smollm2_plain
    prompt = "The capital of France is"
    ids = list(tok(prompt)["input_ids"])
    ref = reference_pieces(model, "llama", ids)
    pieces = capture_pieces(model, find_blocks(model), ids, [len(ids) - 1])
    for layer, r in enumerate(ref, start=1):
        split = pieces.splits[layer]
        assert not split.parallel and split.error <= split.tolerance
        assert torch.equal(pieces.mid[layer][0], (r["pre"] + r["attn"])[-1])
        assert torch.equal(pieces.mlp[layer][0], r["mlp"][-1])
    data = cli.json("lens", smollm2, prompt, "--site", "resid_mid,resid", "--layers", "20:")
    plain = cli.json("lens", smollm2, prompt, "--layers", "20:")
    resid = [row for row in data["layers"] if row["site"] == "resid"]
    assert [{k: r[k] for k in ("layer", "top", "target", "next_rank")} for r in resid] == plain[
        "layers"
    ]
    for row in (r for r in data["layers"] if r["site"] == "resid_mid"):
        h = ref[row["layer"] - 1]
        with torch.no_grad():
            lp = model.get_output_embeddings()(model.model.norm((h["pre"] + h["attn"])[-1]))
        lp = lp.float().log_softmax(-1)
        assert [t["id"] for t in row["top"]] == lp.topk(5).indices.tolist(), row["row"]
        for t in row["top"]:
            assert t["logprob"] == pytest.approx(float(lp[t["id"]]), abs=1e-4)


def test_the_sites_are_the_same_bytes_on_one_thread_and_on_two(tiny, tmp_path):
    """The sites' forward pass and decoding run on the threads the engine's would (one for a
    small pass): on an AMD EPYC a prompt's attn_out rows moved in their last bits between one
    thread and two before they did."""
    import embedlens
    from embedlens.model.prompts import PromptSource
    from tests.test_dist import prompts_file

    folder = tiny("llama-tied")
    prompts = PromptSource.open(prompts_file(tmp_path / "p.jsonl"))
    sites = "attn_out,mlp_out,resid_mid,resid"
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            seen: list[dict[str, Any]] = []
            summary = embedlens.lens_prompts(
                folder, prompts, site=sites, skip_bad=True,
                on_report=lambda report, _line, seen=seen: seen.append(report.to_dict()),
            )  # fmt: skip
            one = embedlens.lens(folder, PROMPT, site=sites, position="all").to_dict()
            runs.append(json.dumps([one, seen, summary.to_dict()], sort_keys=True))
    finally:
        torch.set_num_threads(before)
    assert len(runs[0]) > 1000 and runs[0] == runs[1]
