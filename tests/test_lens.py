"""`embedlens lens`: faithful on every tiny family and on SmolLM2, its options, and bad input.

The references here are written out by hand with plain transformers calls: `output_hidden_states`
for the residual stream, then each family's own final norm / projection / head / post-head step,
so that the lens (which finds all of that generically) is checked against something independent.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models import FAMILIES, TOKENIZER_LEN, VOCAB

PROMPT = "the king of France is"


def _load(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _ids(folder: Path, text: str = PROMPT) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(folder)(text)["input_ids"])


def reference_tail(model: Any, family: str, h: torch.Tensor) -> torch.Tensor:
    """Each family's tail written out by hand: what runs after the last block."""
    if family == "opt":  # no final norm (do_layer_norm_before=False), then project_out
        return model.get_output_embeddings()(model.model.decoder.project_out(h))
    if family == "gpt2":
        return model.get_output_embeddings()(model.transformer.ln_f(h))
    if family == "gpt-neox":
        return model.get_output_embeddings()(model.gpt_neox.final_layer_norm(h))
    if family == "phi":  # the head has a bias
        return model.get_output_embeddings()(model.model.final_layernorm(h))
    logits = model.get_output_embeddings()(model.model.norm(h))
    if family == "gemma2":
        cap = model.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap
    if family == "cohere":
        return logits * model.config.logit_scale
    return logits


def reference_lens(model: Any, family: str, ids: list[int]) -> list[torch.Tensor]:
    """Probabilities [T, V] for every layer: hidden_states[i] (i < L) through the tail; the last
    layer is the model's own logits (hidden_states[-1] is already normalised: never re-normed)."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
        states = out.hidden_states
        rows = [reference_tail(model, family, states[i][0]) for i in range(len(states) - 1)]
        rows.append(out.logits[0])
    return [r.float().softmax(-1) for r in rows]


def assert_top(top: list[dict[str, Any]], probs: torch.Tensor, real: int, tol: float) -> None:
    """The reported top-k are the k best real tokens, with the model's full-softmax probability."""
    best = probs[:real].topk(len(top)).values.tolist()
    assert [t["prob"] for t in top] == pytest.approx(best, abs=tol)
    for t in top:
        assert t["id"] < real
        assert t["prob"] == pytest.approx(float(probs[t["id"]]), abs=tol)


def variant(tmp_path: Path, folder: Path, change: Callable[[Any], None]) -> Path:
    """A copy of a tiny model with some weights changed (tokenizer files kept)."""
    out = tmp_path / (folder.name + "-variant")
    shutil.copytree(folder, out)
    model = _load(folder)
    with torch.no_grad():
        change(model)
    model.save_pretrained(out)
    return out


# --- every family: the self-check passes and every layer equals the hand-written reference -----


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_matches_hand_written_lens(tiny, cli, family):
    folder = tiny(family)
    data = cli.json("lens", folder, PROMPT, "--position", "all", "-k", "3")
    model = _load(folder)
    ids = _ids(folder)
    probs = reference_lens(model, family, ids)
    n = model.config.get_text_config().num_hidden_layers
    assert data["num_layers"] == n
    assert [t["id"] for t in data["tokens"]] == ids
    assert [row["layer"] for row in data["layers"]] == list(range(n + 1))
    assert data["check"]["ok"] and data["check"]["max_abs_logit_diff"] < 1e-4
    assert data["vocab_size"] == VOCAB and data["tokenizer_size"] == TOKENIZER_LEN
    for row in data["layers"]:
        assert_top(row["top"], probs[row["layer"]][-1], TOKENIZER_LEN, 1e-6)
    for row in data["grid"]:
        for cell in row["cells"]:
            assert_top([cell], probs[row["layer"]][cell["position"]], TOKENIZER_LEN, 1e-6)
    if family == "opt":
        assert data["steps"] == ["model.decoder.project_out", "lm_head"]
    if family == "cohere":
        assert data["steps"][-1] == "logits scaled by 0.25"


def test_softcapping_applied_once(tiny, cli, tmp_path):
    """Gemma-2 with logits far past the cap: the lens equals the capped model, not the raw head."""
    folder = variant(tmp_path, tiny("gemma2"), lambda m: m.model.norm.weight.fill_(300.0))
    data = cli.json("lens", folder, PROMPT, "-k", "3")
    model = _load(folder)
    ids = _ids(folder)
    probs = reference_lens(model, "gemma2", ids)
    assert data["check"]["ok"]
    assert "softcapping c·tanh(logits/c), c = 3" in data["steps"]
    for row in data["layers"]:
        assert_top(row["top"], probs[row["layer"]][-1], TOKENIZER_LEN, 1e-5)
    with torch.no_grad():
        raw = model.get_output_embeddings()(
            model.model.norm(
                model(torch.tensor([ids]), output_hidden_states=True).hidden_states[1][0, -1]
            )
        ).softmax(-1)
    assert float((raw - probs[1][-1]).abs().max()) > 0.05  # without the cap it would differ


def test_logit_scale_and_head_bias(tiny, cli, tmp_path):
    """Cohere's logit scale and Phi's head bias, each made large enough to matter."""
    cohere = variant(tmp_path / "c", tiny("cohere"), lambda m: m.model.norm.weight.fill_(40.0))
    torch.manual_seed(1)
    phi = variant(
        tmp_path / "p", tiny("phi"), lambda m: m.lm_head.bias.copy_(3 * torch.randn(VOCAB))
    )
    for family, folder in (("cohere", cohere), ("phi", phi)):
        data = cli.json("lens", folder, PROMPT)
        probs = reference_lens(_load(folder), family, _ids(folder))
        assert data["check"]["ok"], family
        for row in data["layers"]:
            assert_top(row["top"], probs[row["layer"]][-1], TOKENIZER_LEN, 1e-5)
    model = _load(phi)
    with torch.no_grad():
        h = model(torch.tensor([_ids(phi)]), output_hidden_states=True).hidden_states[0][0, -1]
        unbiased = (model.model.final_layernorm(h) @ model.lm_head.weight.T).softmax(-1)
    assert float((unbiased - reference_lens(model, "phi", _ids(phi))[0][-1]).abs().max()) > 0.05


def test_padding_rows_never_predicted(tiny, cli, tmp_path):
    """Padding rows hold almost all the probability: never shown, yet the softmax includes them."""

    def boost_padding(m: Any) -> None:
        m.lm_head.bias.zero_()
        m.lm_head.bias[TOKENIZER_LEN:] = 30.0

    folder = variant(tmp_path, tiny("phi"), boost_padding)
    data = cli.json("lens", folder, PROMPT, "--position", "all")
    probs = reference_lens(_load(folder), "phi", _ids(folder))
    for row in data["layers"]:
        assert all(t["id"] < TOKENIZER_LEN for t in row["top"])
        assert sum(t["prob"] for t in row["top"]) < 1e-3
        assert_top(row["top"], probs[row["layer"]][-1], TOKENIZER_LEN, 1e-9)
    assert all(c["id"] < TOKENIZER_LEN for row in data["grid"] for c in row["cells"])


def test_decodes_only_the_positions_asked_for(tiny):
    from embedlens.analysis.lens.engine import run_lens

    model = _load(tiny("llama-untied"))
    seen: list[int] = []
    model.lm_head.register_forward_hook(
        lambda _m, args, _o: seen.append(args[0].shape[:-1].numel())
    )
    ids = _ids(tiny("llama-untied"))
    run_lens(model, ids, layers=[0, 1], positions=[2], k=3, real_vocab=TOKENIZER_LEN)
    # the real pass keeps one position; the lens decodes layers 0, 1 and the last block (for the
    # self-check) at that position, then one row to name the steps after the last block
    assert seen == [1, 3, 1]


def test_self_check_failure_is_loud(tiny, cli, monkeypatch):
    """A model whose logits depend on the position after its blocks: the lens cannot follow."""
    from embedlens.model import loading

    real_load = loading.load_model

    def load(*args: Any, **kwargs: Any) -> Any:
        model = real_load(*args, **kwargs)

        def shift(_m: Any, _args: Any, out: Any) -> Any:
            t = out.logits.shape[1]
            out.logits = out.logits + torch.arange(t, dtype=out.logits.dtype)[None, :, None]
            return out

        model.register_forward_hook(shift)
        return model

    monkeypatch.setattr(loading, "load_model", load)
    result = cli("lens", tiny("llama-tied"), PROMPT, "--position", "all", "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert not data["check"]["ok"] and data["check"]["max_abs_logit_diff"] > 1
    assert "after the head" in data["check"]["suspect"]
    assert "warning: the lens does not reproduce" in result.stderr
    assert "suspect" in result.stderr


# --- the real model ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2_plain(smollm2: Path) -> tuple[Any, Any]:
    """SmolLM2 loaded the plain transformers way, float32: the reference for the lens.

    transformers' own from_pretrained, only with its repeated GGUF parsing shared (which saves
    half a minute here and changes no value: ' Paris' at 0.773, REFERENCE.md, pins the weights).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from embedlens.compat.transformers.gguf_patches import sharing_gguf_reads

    where, name = str(smollm2.parent), str(smollm2)
    with sharing_gguf_reads():
        tok = AutoTokenizer.from_pretrained(where, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    return model.eval(), tok


def test_smollm2_paris_and_every_layer_as_plain_transformers(
    smollm2, smollm2_plain, cli, tmp_path, monkeypatch
):
    model, tok = smollm2_plain
    prompt = "The capital of France is"
    # from_pretrained looks for gguf_file in the working directory first: a same-named file
    # there must not be what gets loaded
    (tmp_path / smollm2.name).write_bytes(b"not the model")
    monkeypatch.chdir(tmp_path)
    data = cli.json("lens", smollm2, prompt, "--target", " Paris")
    ids = list(tok(prompt)["input_ids"])
    assert [t["id"] for t in data["tokens"]] == ids
    assert [t["token"] for t in data["tokens"]] == ["The", " capital", " of", " France", " is"]
    assert data["num_layers"] == 30 and len(data["layers"]) == 31
    assert data["dtype"] == "float32"
    assert data["check"]["ok"] and data["check"]["max_abs_logit_diff"] < 1e-3
    assert data["steps"] == ["model.norm", "lm_head"]
    last = data["layers"][-1]
    assert last["top"][0]["token"] == " Paris"
    assert last["top"][0]["prob"] == pytest.approx(0.773, abs=5e-4)
    top1 = last["top"][0]
    assert last["target"] == {"prob": top1["prob"], "rank": 1, "logprob": top1["logprob"]}
    assert data["target"] == {"text": " Paris", "id": tok.convert_tokens_to_ids("ĠParis"),
                              "token": " Paris"}  # fmt: skip
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
        states = out.hidden_states
        for row in data["layers"]:
            layer = row["layer"]
            if layer < len(states) - 1:
                logits = model.get_output_embeddings()(model.model.norm(states[layer][0, -1]))
            else:
                logits = out.logits[0, -1]
            probs = logits.softmax(-1)
            assert [t["id"] for t in row["top"]] == logits.topk(5).indices.tolist(), layer
            assert_top(row["top"], probs, len(tok), 1e-4)
            target = data["target"]["id"]
            assert row["target"]["prob"] == pytest.approx(float(probs[target]), abs=1e-4)
            real = logits[: len(tok)]
            assert row["target"]["rank"] == int((real > logits[target]).sum()) + 1, layer


# --- options -------------------------------------------------------------------------------------


def test_layers_position_and_target(tiny, cli):
    folder = tiny("llama-tied")
    full = cli.json("lens", folder, PROMPT, "--position", "1", "--target", "queen", "-k", "2")
    assert full["position"] == 1 and full["position_index"] == 1
    assert full["target"]["token"] == "queen"
    for row in full["layers"]:
        rank = row["target"]["rank"]
        assert rank >= 1 and (rank == 1) == (row["top"][0]["token"] == "queen")
    picked = cli.json("lens", folder, PROMPT, "--position", "1", "--layers", "0,2:", "-k", "2")
    assert [r["layer"] for r in picked["layers"]] == [0, 2, 3]
    same = {r["layer"]: r["top"] for r in full["layers"]}
    for row in picked["layers"]:
        assert [t["id"] for t in row["top"]] == [t["id"] for t in same[row["layer"]]]
        assert [t["prob"] for t in row["top"]] == pytest.approx(
            [t["prob"] for t in same[row["layer"]]], abs=1e-6
        )
    last = cli.json("lens", folder, PROMPT, "--layers", "-1,:1")
    assert [r["layer"] for r in last["layers"]] == [0, 3]
    assert last["position"] == -1 and last["position_index"] == 4
    assert last["grid"] is None


def test_chat_template_and_switches(tiny, cli, tmp_path):
    folder = tiny("llama-tied")
    data = cli.json("lens", folder, "Paris", "--chat", "the capital of France is")
    words = [t["token"] for t in data["tokens"]]
    assert words == ["<s>", "the", "capital", "of", "France", "is", "</s>", "<s>", "Paris"]
    assert data["chat"] == "the capital of France is"
    thinking = tmp_path / "thinking"
    shutil.copytree(folder, thinking)
    template = (thinking / "chat_template.jinja").read_text()
    (thinking / "chat_template.jinja").write_text(
        template + "{% if enable_thinking is defined and not enable_thinking %}red {% endif %}"
    )
    plain = cli.json("lens", thinking, "Paris", "--chat", "the capital")
    off = cli.json("lens", thinking, "Paris", "--chat", "the capital", "--no-thinking")
    same = cli.json(
        "lens",
        thinking,
        "Paris",
        "--chat",
        "the capital",
        "--template-arg",
        "enable_thinking=false",
    )
    assert "red" not in [t["token"] for t in plain["tokens"]]
    assert [t["token"] for t in off["tokens"]][-2:] == ["red", "Paris"]
    assert same["tokens"] == off["tokens"]


def test_device_map_offloads_and_agrees(tiny, cli):
    folder = tiny("llama-untied")
    here = cli.json("lens", folder, PROMPT)
    spread = cli.json("lens", folder, PROMPT, "--device-map", "auto", "--max-memory", "cpu=100KB")
    assert here["placement"] is None
    assert set(spread["placement"]) == {"cpu", "disk"}
    assert spread["check"]["ok"]
    for a, b in zip(here["layers"], spread["layers"], strict=True):
        assert [t["id"] for t in a["top"]] == [t["id"] for t in b["top"]]
        assert [t["prob"] for t in a["top"]] == pytest.approx([t["prob"] for t in b["top"]])


def test_bfloat16_runs_and_checks_itself(tiny, cli):
    data = cli.json("lens", tiny("qwen3"), PROMPT, "--dtype", "bfloat16")
    assert data["dtype"] == "bfloat16"
    assert data["check"]["ok"] and data["check"]["tolerance"] >= 1e-3


@pytest.mark.slow  # draws with matplotlib
@pytest.mark.parametrize("suffix", [".png", ".svg", ".html"])
def test_plot(tiny, cli, tmp_path, suffix):
    out = tmp_path / ("lens" + suffix)
    result = cli("lens", tiny("gpt2"), PROMPT, "--plot", out)
    assert result.exit_code == 0, result.stderr
    data = out.read_bytes()
    if suffix == ".png":
        assert data.startswith(b"\x89PNG")
    else:
        text = data.decode()
        assert "<svg" in text and "king" in text
        assert text.startswith("<!DOCTYPE html>") == (suffix == ".html")


def test_rich_table(tiny, cli):
    result = cli("lens", tiny("opt"), PROMPT, "--target", "Paris", "--position", "all")
    assert result.exit_code == 0, result.stderr
    assert "'is'" in result.stdout and "p('Paris')" in result.stdout
    assert "self-check" in result.stdout and "project_out" in result.stdout
    assert "Top-1 at every layer" in result.stdout


def test_help_says_float32(cli):
    result = cli("lens", "--help")
    assert result.exit_code == 0
    assert "float32" in result.stdout


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["", "-k", "3"], "the prompt is empty"),
        ([PROMPT, "--layers", "9"], "layer 9 is out of range: the model has layers 0..3"),
        ([PROMPT, "--layers", "0:9"], "layer 9 is out of range"),
        ([PROMPT, "--layers", "4:4"], "layer 4 is out of range"),  # a start is no stop
        ([PROMPT, "--layers", "1-2"], "malformed --layers '1-2'"),
        ([PROMPT, "--layers", "0,,2"], "malformed --layers"),
        ([PROMPT, "--layers", "a:b"], "malformed --layers"),
        ([PROMPT, "-k", "0"], "-k must be at least 1"),
        ([PROMPT, "--target", "king queen"], "splits into 2 ('king', 'queen')"),
        ([PROMPT, "--target", "zebra"], "'zebra' is not in the vocabulary"),
        ([" ".join(["the"] * 65)], "the prompt is 65 tokens, longer than the model's context (64)"),
        ([PROMPT, "--position", "5"], "position 5 is out of range: the prompt has 5 tokens"),
        ([PROMPT, "--position", "first"], "--position must be an integer or 'all'"),
        ([PROMPT, "--plot", "x.gif"], "unknown format"),
        ([PROMPT, "--no-thinking"], "only apply with --chat"),
        ([PROMPT, "--device-map", "everywhere"], "Invalid value for '--device-map'"),
        ([PROMPT, "--max-memory", "cpu=1GB"], "only apply with --device-map"),
    ],
)
def test_bad_input(tiny, cli, args, message):
    err = cli.fails("lens", tiny("llama-tied"), *args, code=2)
    assert message in err


def test_chat_without_template(tiny, cli, tmp_path):
    folder = tmp_path / "no-template"
    shutil.copytree(tiny("llama-tied"), folder)
    (folder / "chat_template.jinja").unlink()
    err = cli.fails("lens", folder, "Paris", "--chat", "hello", code=2)
    assert "no chat template" in err


def test_chunked_decoding_matches_one_pass(tiny, monkeypatch):
    """Rows decoded a few at a time give what one pass gives (the grid never holds all logits)."""
    from embedlens.analysis.lens import engine as analysis

    model = _load(tiny("qwen3"))
    ids = _ids(tiny("qwen3"))
    args = {"layers": [0, 1, 2, 3], "positions": list(range(len(ids))), "k": 4}
    whole = analysis.run_lens(model, ids, real_vocab=TOKENIZER_LEN, target=20, **args)
    monkeypatch.setattr(analysis, "CHUNK_BYTES", 3 * 4 * VOCAB)  # three rows at a time
    parts = analysis.run_lens(model, ids, real_vocab=TOKENIZER_LEN, target=20, **args)
    assert whole.rows.keys() == parts.rows.keys()
    for key, top in whole.rows.items():
        assert parts.rows[key].ids == top.ids
        assert parts.rows[key].probs == pytest.approx(top.probs, abs=1e-6)
        assert parts.rows[key].target_rank == top.target_rank
    assert parts.check.ok and parts.check.max_abs_logit_diff == pytest.approx(
        whole.check.max_abs_logit_diff, abs=1e-6
    )


def test_tail_that_counts_its_blocks_runs_them_all(tiny):
    """A model whose code after the blocks depends on how many there are: the lens notices that
    the shortened tail does not reproduce it and decodes with every block in place instead."""
    from embedlens.analysis.lens.engine import run_lens

    model = _load(tiny("llama-tied"))

    def by_depth(module: Any, _args: Any, out: Any) -> Any:
        out.last_hidden_state = out.last_hidden_state * len(module.layers)
        return out

    model.model.register_forward_hook(by_depth)
    ids = _ids(tiny("llama-tied"))
    result = run_lens(model, ids, layers=[0, 3], positions=[4], k=3, real_vocab=TOKENIZER_LEN)
    assert result.full_tail and result.check.ok
    with torch.no_grad():
        h = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[0][0, -1]
        probs = model.get_output_embeddings()(model.model.norm(h) * 3).softmax(-1)
    assert result.rows[(0, 4)].probs == pytest.approx(
        probs[:TOKENIZER_LEN].topk(3).values.tolist(), abs=1e-6
    )
