"""`lens A --against B`: two models' lenses on the same ids, layer by layer.

The pairs are tiny models and modified copies of them (one block's weights changed, the final
norm alone changed), checked for the zeros the definitions promise, and against a plain
transformers computation of both models' lenses; SmolLM2 against its own weights rounded to
another GGUF type gives a small, nonzero KL. From the library and the command line, one prompt
and many.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from embedlens.analysis.lens import lens, lens_prompts
from embedlens.analysis.lens.options import DEFAULT_THRESHOLD
from embedlens.errors import UnsupportedError, UsageError

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "the king of France is"
PROMPTS = [
    {"prompt": "the king of France is", "target": "Paris", "id": "a"},
    {"prompt": "a big red", "target": "car"},
    {"prompt": "the capital city of Italy is Rome and the capital of Germany is"},
]
FINAL_NORM = {
    "llama-untied": "model.norm",
    "gpt2": "transformer.ln_f",
    "gpt-neox": "gpt_neox.final_layer_norm",
    "gemma2": "model.norm",
}
"""Families the pairs are built on (4 architectures), and the module of each one's final norm."""
FAMILIES = list(FINAL_NORM)
BLOCK = 1
"""The block the 'block' copy changes: its output is layer BLOCK + 1."""


# --- the pairs -------------------------------------------------------------------------------


def _copy(source: Path, folder: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    weights = load_file(folder / "model.safetensors")
    change(weights)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def pairs(tiny, tmp_path_factory) -> Callable[[str], dict[str, Path]]:
    """pairs(family) -> {'a': the model, 'block': block BLOCK changed, 'norm': the final norm
    changed}, built once."""
    built: dict[str, dict[str, Path]] = {}

    def make(family: str) -> dict[str, Path]:
        if family not in built:
            a = tiny(family)
            root = tmp_path_factory.mktemp(f"pair-{family}")
            noise = torch.Generator().manual_seed(1)
            pattern = re.compile(rf"\.(layers|h)\.{BLOCK}\.")

            def block(w: dict[str, torch.Tensor]) -> None:
                for name in [n for n in w if pattern.search(n) and w[n].ndim == 2]:
                    w[name] = w[name] + 0.5 * torch.randn(w[name].shape, generator=noise)

            def norm(w: dict[str, torch.Tensor]) -> None:
                name = FINAL_NORM[family] + ".weight"
                w[name] = w[name] * 3 + (1.0 if family == "gemma2" else 0.0)  # gemma: 1 + w

            built[family] = {
                "a": a,
                "block": _copy(a, root / "block", block),
                "norm": _copy(a, root / "norm", norm),
            }
        return built[family]

    return make


def _kls(report: Any) -> list[float]:
    return [row.kl for row in report.diff.layers]


def _residual_kls(report: Any) -> list[float]:
    return [row.residual_kl for row in report.diff.layers]


# --- the zeros the definitions promise ---------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_a_model_against_itself_is_zero_everywhere(pairs, family):
    a = pairs(family)["a"]
    report = lens(a, PROMPT, target="Paris", against=a)
    d = report.diff
    assert [row.layer for row in d.layers] == [0, 1, 2, 3]
    assert _kls(report) == [0.0] * 4 and _residual_kls(report) == [0.0] * 4
    assert all(row.top1_agree for row in d.layers)
    assert [row.target_logprob_delta for row in d.layers] == [0.0] * 4
    assert d.first_divergent_layer is None and d.threshold == DEFAULT_THRESHOLD
    assert [[p.id for p in row.against_top] for row in d.layers] == [
        [p.id for p in row.top] for row in report.layers
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_one_block_changed_parts_at_its_output(pairs, family):
    p = pairs(family)
    report = lens(p["a"], PROMPT, against=p["block"])
    kls, residual = _kls(report), _residual_kls(report)
    out = BLOCK + 1
    assert kls[:out] == [0.0] * out and residual[:out] == [0.0] * out
    assert all(kl > 1e-3 for kl in kls[out:]), kls
    assert all(kl > 1e-3 for kl in residual[out:]), residual
    assert report.diff.first_divergent_layer == out


@pytest.mark.parametrize("family", FAMILIES)
def test_final_norm_changed_moves_kl_but_not_the_residual(pairs, family):
    p = pairs(family)
    report = lens(p["a"], PROMPT, against=p["norm"])
    assert all(kl > 1e-3 for kl in _kls(report)), _kls(report)
    assert _residual_kls(report) == [0.0] * 4
    assert report.diff.first_divergent_layer == 0


@pytest.mark.parametrize("family", FAMILIES[:2])
def test_many_prompts_give_the_same_zeros(pairs, family):
    p = pairs(family)
    out = BLOCK + 1
    each: list[Any] = []
    summary = lens_prompts(p["a"], PROMPTS, against=p["a"], on_report=lambda r, _: each.append(r))
    d = summary.diff
    assert [row.kl for row in d.layers] == [0.0] * 4
    assert [row.top1_agreement for row in d.layers] == [1.0] * 4
    assert d.first_divergent_layer is None and len(each) == 3
    assert all(_kls(r) == [0.0] * 4 and r.diff.first_divergent_layer is None for r in each)
    block = lens_prompts(p["a"], PROMPTS, against=p["block"]).diff
    assert [row.kl for row in block.layers][:out] == [0.0] * out
    assert all(row.kl > 1e-3 for row in block.layers[out:])
    assert block.first_divergent_layer == out
    norm = lens_prompts(p["a"], PROMPTS, against=p["norm"]).diff
    assert all(row.kl > 1e-3 for row in norm.layers)
    assert [row.residual_kl for row in norm.layers] == [0.0] * 4


# --- less work for the same figures ------------------------------------------------------------


@pytest.mark.parametrize("many", [False, True])
def test_the_residual_kl_is_taken_again_only_where_rows_differ(pairs, monkeypatch, many):
    """KL is taken again only for the layers whose rows differ in some bit from the lens
    pair's: B's residual through A's decoder is B's lens where the tails match (a block
    changed), so at most the last layer is taken again (A's decoding of its last block beside
    its own output); where the final norm changed, every layer is. The figures are those of
    taking every layer again."""
    from embedlens.analysis.lens import pairing

    real = pairing.kl_rows
    rows: list[int] = []

    def counted(p: torch.Tensor, q: torch.Tensor) -> list[float]:
        rows.append(len(p))
        return real(p, q)

    monkeypatch.setattr(pairing, "kl_rows", counted)
    p = pairs("llama-untied")
    for b, again in ((p["block"], (0, 1)), (p["norm"], (4,))):
        rows.clear()
        got = _residual_of(p["a"], b, many)
        assert rows[0] == 4 and sum(rows[1:]) in again, rows
        with monkeypatch.context() as m:
            m.setattr(pairing, "same_bits", lambda x, y: False)
            rows.clear()
            assert _residual_of(p["a"], b, many) == got and rows == [4, 4]


def _residual_of(a: Path, b: Path, many: bool) -> list[float]:
    """The residual KL of each layer: of one prompt, or the means over one line of many."""
    if not many:
        return _residual_kls(lens(a, PROMPT, against=b))
    return [row.residual_kl for row in lens_prompts(a, PROMPTS[:1], against=b).diff.layers]


def test_kept_rows_are_the_chunk_itself_when_every_row_is_kept():
    """A chunk whose rows are all kept is kept as it is (no copy of its logits); some rows of
    it are copied, so that the chunk is let go."""
    from embedlens.analysis.lens.report import kept_rows

    out, theirs = torch.randn(3, 5), torch.randn(3, 5)
    own, none = kept_rows(["a", "b", "c"], out)
    assert [k for k, _ in own] == ["a", "b", "c"] and none == []
    assert all(row.data_ptr() == out[i].data_ptr() for i, (_, row) in enumerate(own))
    some, other = kept_rows(["a", None, "c"], out, theirs)
    assert [k for k, _ in some] == ["a", "c"] and [k for k, _ in other] == ["a", "c"]
    assert torch.equal(torch.stack([row for _, row in other]), theirs[[0, 2]])
    assert torch.equal(torch.stack([row for _, row in some]), out[[0, 2]])
    assert all(
        row.untyped_storage().data_ptr() != out.untyped_storage().data_ptr() for _, row in some
    )


def test_kl_rows_keeps_0_log_0_and_same_bits_tells_signed_zeros():
    from embedlens.analysis.lens.pairing import kl_rows, same_bits

    p = torch.tensor([[0.0, -math.inf, 1.0], [0.5, 0.25, 1.0]])
    q = torch.tensor([[0.0, 3.0, 1.0], [0.5, 0.25, 1.0]])
    lp, lq = torch.log_softmax(p.double(), -1), torch.log_softmax(q.double(), -1)
    terms = torch.where(torch.isneginf(lp), 0.0, lp.exp() * (lp - lq))
    assert kl_rows(p, q) == terms.sum(-1).clamp_min(0.0).tolist()
    assert not math.isnan(kl_rows(p, q)[0]) and kl_rows(p, q)[1] == 0.0
    row = torch.tensor([0.0, 1.0])
    assert same_bits(row, row.clone()) and not same_bits(row, torch.tensor([-0.0, 1.0]))
    nan = torch.tensor([math.nan, 1.0])
    assert same_bits(nan, nan.clone()) and not same_bits(row, row.double())


# --- the figures against plain transformers ----------------------------------------------------


def _plain_lens(folder: Path, family: str, ids: list[int], position: int) -> tuple[Any, Any]:
    """(every layer's residual at `position` [L+1, d], the tail as a function), computed with
    transformers alone: hidden_states, the final norm's input for the last block's output."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    norm = model.get_submodule(FINAL_NORM[family])
    last: list[torch.Tensor] = []
    hook = norm.register_forward_pre_hook(lambda _m, args: last.append(args[0]))
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    hook.remove()
    rows = torch.stack([*(h[0, position] for h in out.hidden_states[:-1]), last[0][0, position]])
    cap = getattr(model.config, "final_logit_softcapping", None)

    def tail(h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            x = model.get_output_embeddings()(norm(h))
        return x if cap is None else torch.tanh(x / cap) * cap

    return rows, tail


def _plain_kl(p: torch.Tensor, q: torch.Tensor) -> list[float]:
    lp, lq = torch.log_softmax(p.double(), -1), torch.log_softmax(q.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1).tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_figures_match_a_plain_transformers_computation(pairs, family):
    from transformers import AutoTokenizer

    p = pairs(family)
    ids = AutoTokenizer.from_pretrained(p["a"])(PROMPT)["input_ids"]
    pos = len(ids) - 1
    ha, tail_a = _plain_lens(p["a"], family, ids, pos)
    for copy in ("block", "norm"):
        hb, tail_b = _plain_lens(p[copy], family, ids, pos)
        lens_a, lens_b, a_on_b = tail_a(ha), tail_b(hb), tail_a(hb)
        report = lens(p["a"], PROMPT, target="Paris", against=p[copy])
        kl = _plain_kl(lens_a, lens_b)
        residual = _plain_kl(lens_a, a_on_b)
        assert _kls(report) == pytest.approx(kl, rel=1e-3, abs=1e-9), copy
        assert _residual_kls(report) == pytest.approx(residual, rel=1e-3, abs=1e-9), copy
        logp_a = torch.log_softmax(lens_a.double(), -1)[:, report.target.id]
        logp_b = torch.log_softmax(lens_b.double(), -1)[:, report.target.id]
        shown = [row.target_logprob_delta for row in report.diff.layers]
        assert shown == pytest.approx((logp_b - logp_a).tolist(), rel=1e-3, abs=1e-6), copy
        agree = (lens_a.argmax(-1) == lens_b.argmax(-1)).tolist()
        assert [row.top1_agree for row in report.diff.layers] == agree, copy


@pytest.mark.parametrize("family", FAMILIES)
def test_each_prompt_of_many_equals_its_single_run(pairs, family):
    """The batch's figures are the single run's, up to float32 rounding; the summary's means are
    the means of them."""
    p = pairs(family)
    each: list[Any] = []
    summary = lens_prompts(
        p["a"], PROMPTS, against=p["block"], on_report=lambda r, _: each.append(r)
    )
    for row, got in zip(PROMPTS, each, strict=True):
        alone = lens(p["a"], row["prompt"], target=row.get("target"), against=p["block"])
        assert _kls(got) == pytest.approx(_kls(alone), rel=1e-3, abs=1e-9)
        assert _residual_kls(got) == pytest.approx(_residual_kls(alone), rel=1e-3, abs=1e-9)
    means = [sum(_kls(r)[i] for r in each) / len(each) for i in range(4)]
    assert [row.kl for row in summary.diff.layers] == pytest.approx(means, rel=1e-12)


# --- A's own report, loaded models, memory ----------------------------------------------------


def _without(data: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k not in keys}


def test_the_pair_report_holds_a_s_own_report(pairs):
    p = pairs("llama-untied")
    alone = lens(p["a"], PROMPT, target="Paris", position="all").to_dict()
    pair = lens(p["a"], PROMPT, target="Paris", position="all", against=p["block"]).to_dict()
    assert _without(pair, "diff") == alone
    each: list[Any] = []
    lens_prompts(p["a"], PROMPTS, on_report=lambda r, _: each.append(r.to_dict()))
    with_b: list[Any] = []
    lens_prompts(
        p["a"], PROMPTS, against=p["norm"], on_report=lambda r, _: with_b.append(r.to_dict())
    )
    assert [_without(r, "diff") for r in with_b] == each


def test_loaded_models_give_the_files_figures(pairs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = pairs("llama-untied")
    a = AutoModelForCausalLM.from_pretrained(p["a"], dtype=torch.float32)
    b = AutoModelForCausalLM.from_pretrained(p["block"], dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(p["a"])
    loaded = lens(a, PROMPT, tokenizer=tok, against=b)
    files = lens(p["a"], PROMPT, against=p["block"])
    assert _kls(loaded) == _kls(files) and _residual_kls(loaded) == _residual_kls(files)
    summary = lens_prompts(a, PROMPTS, tokenizer=tok, against=b, against_tokenizer=tok)
    assert summary.diff.first_divergent_layer == BLOCK + 1


def test_both_memory_paths_give_the_same_figures(pairs, monkeypatch):
    """Two models that do not fit together run one after the other (B's rows wait on disk);
    the figures are those of the run that holds both."""
    from embedlens.io.source import resolve
    from embedlens.model.preflight import estimate

    p = pairs("llama-untied")
    monkeypatch.setattr("embedlens.analysis.lens.against.KEEP_BYTES", 1)  # a window per prompt
    together = lens_prompts(p["a"], PROMPTS, against=p["block"], top_k=3)
    assert not any("ran first" in n for n in together.notes)
    need = [estimate(resolve(str(p[k])), "float32") for k in ("a", "block")]
    one = max(e.needed for e in need if e is not None)
    monkeypatch.setenv("EMBEDLENS_MEMORY_LIMIT", str(one))
    each: list[Any] = []
    apart = lens_prompts(
        p["a"], PROMPTS, against=p["block"], top_k=3, on_report=lambda r, _: each.append(r)
    )
    assert any(f"'{p['block']}' ran first, and was freed" in n for n in apart.notes)
    assert _without(apart.to_dict(), "notes") == _without(together.to_dict(), "notes")
    assert [r.diff.first_divergent_layer for r in each] == [BLOCK + 1] * 3


# --- refusals --------------------------------------------------------------------------------


def _other_vocabulary(a: Path, folder: Path) -> Path:
    """A copy whose tokenizer gives 'king' and 'queen' each other's ids."""
    shutil.copytree(a, folder)
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    vocab["king"], vocab["queen"] = vocab["queen"], vocab["king"]
    path.write_text(json.dumps(data))
    return folder


def test_another_vocabulary_is_refused_before_any_weight_is_read(pairs, cli, tmp_path, monkeypatch):
    a = pairs("llama-untied")["a"]
    other = _other_vocabulary(a, tmp_path / "other")
    err = cli.fails("lens", a, PROMPT, "--against", other, code=1)
    assert f"'{other}' does not share the vocabulary of '{a}'" in err
    assert "2 tokens have other ids there (id 15 moved by +1)" in err
    assert "embedlens vocab" in err
    longer = tmp_path / "longer"
    shutil.copytree(a, longer)
    data = json.loads((longer / "tokenizer.json").read_text())
    data["model"]["vocab"]["extra"] = len(data["model"]["vocab"])
    (longer / "tokenizer.json").write_text(json.dumps(data))
    err = cli.fails("lens", a, PROMPT, "--against", longer, code=1)
    assert f"58 of 58 ids hold the same token (59 in '{longer}'); 1 token only in" in err

    def no_load(*_a: Any, **_k: Any) -> None:
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("embedlens.model.loading.load_model", no_load)
    with pytest.raises(UnsupportedError, match="does not share the vocabulary"):
        lens_prompts(a, PROMPTS, against=other)


def test_another_number_of_layers_is_refused(pairs, cli, tmp_path):
    from safetensors.torch import load_file, save_file

    a = pairs("llama-untied")["a"]
    short = tmp_path / "short"
    shutil.copytree(a, short)
    config = json.loads((short / "config.json").read_text())
    config["num_hidden_layers"] = 2
    (short / "config.json").write_text(json.dumps(config))
    weights = {k: v for k, v in load_file(short / "model.safetensors").items() if ".2." not in k}
    save_file(weights, short / "model.safetensors", metadata={"format": "pt"})
    err = cli.fails("lens", a, PROMPT, "--against", short, code=1)
    assert f"'{short}' has 2 layers and '{a}' 3" in err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--threshold", "0.1"], "--threshold applies only with --against"),
        (["--against-revision", "main"], "apply only with --against"),
        (["--against", "{a}", "--threshold", "-1"], "at least 0"),
        (["--against", "{a}", "--threshold", "nan"], "at least 0"),
    ],
)
def test_against_options_alone_or_out_of_range(pairs, cli, args, says):
    a = pairs("llama-untied")["a"]
    err = cli.fails("lens", a, PROMPT, *[x.format(a=a) for x in args], code=2)
    assert says in err


def test_threshold_from_python_is_checked():
    with pytest.raises(UsageError, match="only with --against"):
        lens("no-such-model", PROMPT, threshold=0.5)


# --- the command line -------------------------------------------------------------------------


def test_cli_json_table_and_threshold(pairs, cli):
    p = pairs("llama-untied")
    data = cli.json("lens", p["a"], PROMPT, "--against", p["block"], "--target", "Paris")
    diff = data["diff"]
    assert list(diff) == [
        "against",
        "threshold",
        "first_divergent_layer",
        "layers",
        "against_check",
    ]
    assert diff["first_divergent_layer"] == BLOCK + 1 and diff["against"] == str(p["block"])
    assert list(diff["layers"][0])[:5] == [
        "layer", "kl", "top1_agree", "residual_kl", "target_logprob_delta",
    ]  # fmt: skip
    assert data == lens(p["a"], PROMPT, against=p["block"], target="Paris").to_dict()
    high = cli.json("lens", p["a"], PROMPT, "--against", p["block"], "--threshold", "10")
    assert high["diff"]["first_divergent_layer"] is None and high["diff"]["threshold"] == 10
    table = cli("lens", p["a"], PROMPT, "--against", p["block"])
    assert table.exit_code == 0, table.stderr
    marked = [line for line in table.stdout.splitlines() if "◀" in line]
    assert len(marked) == 2 and marked[0].split("│")[1].strip() == f"{BLOCK + 1} ◀"
    assert "First divergent layer: 2 ◀ (KL > 1e-06 nats)" in " ".join(table.stdout.split())


def test_the_first_divergent_layer_is_found_among_layers_not_shown(pairs, cli):
    """--layers picks the rows shown, not where the models part: the block pair parts at layer
    BLOCK + 1 and the norm pair at 0 whatever --layers shows; the table says the layer is not
    among its rows, and the rows shown hold the figures of a run showing every layer."""
    p = pairs("llama-untied")
    every = lens(p["a"], PROMPT, against=p["block"], target="Paris")
    for pair, layers, first in (("block", "3:", BLOCK + 1), ("norm", "2:", 0)):
        data = cli.json("lens", p["a"], PROMPT, "--against", p[pair], "--layers", layers)
        assert data["diff"]["first_divergent_layer"] == first
        assert [row["layer"] for row in data["diff"]["layers"]] == list(range(int(layers[0]), 4))
        table = cli("lens", p["a"], PROMPT, "--against", p[pair], "--layers", layers)
        assert table.exit_code == 0, table.stderr
        assert "◀" not in table.stdout
        said = " ".join(table.stdout.split())
        assert f"First divergent layer: {first} (KL > 1e-06 nats), not among the layers shown" in (
            said
        )
    late = lens(p["a"], PROMPT, against=p["block"], target="Paris", layers="3:").to_dict()
    whole = every.to_dict()
    assert late["diff"]["layers"] == whole["diff"]["layers"][3:]
    assert late["layers"] == whole["layers"][3:]


@pytest.mark.parametrize("apart", [False, True])
def test_over_prompts_the_first_divergent_layer_is_found_among_layers_not_shown(
    pairs, cli, tmp_path, monkeypatch, apart
):
    """--prompts as one prompt: the summary's first divergent layer (and each line's) is found
    among every layer whatever --layers shows, whether the two models run together or one after
    the other; the table says it is not among its rows, and the rows shown hold the figures of
    a run showing every layer."""
    p = pairs("llama-untied")
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    if apart:  # room for one model at a time
        from embedlens.io.source import resolve
        from embedlens.model.preflight import estimate

        need = [estimate(resolve(str(p[k])), "float32") for k in ("a", "block", "norm")]
        monkeypatch.setenv("EMBEDLENS_MEMORY_LIMIT", str(max(e.needed for e in need if e)))
    for pair, layers, first in (("block", "3:", BLOCK + 1), ("norm", "2:", 0)):
        args = ("lens", p["a"], "--prompts", path, "--against", p[pair], "--layers", layers)
        data = [json.loads(line) for line in cli(*args, "--json").stdout.splitlines()]
        assert [line["diff"]["first_divergent_layer"] for line in data] == [first] * 4
        start = int(layers[0])
        for line in data:
            assert [row["layer"] for row in line["diff"]["layers"]] == list(range(start, 4))
            assert [row["layer"] for row in line["layers"]] == list(range(start, 4))
        assert any("ran first" in n for n in data[-1]["notes"]) == apart
        table = cli(*args)
        assert table.exit_code == 0, table.stderr
        assert "◀" not in table.stdout
        said = " ".join(table.stdout.split())
        assert f"First divergent layer: {first} (mean KL > 1e-06 nats), not among the layers " in (
            said
        )
    whole = lens_prompts(p["a"], PROMPTS, against=p["block"]).to_dict()
    late = lens_prompts(p["a"], PROMPTS, against=p["block"], layers="3:").to_dict()
    assert late["diff"]["layers"] == whole["diff"]["layers"][3:]
    assert late["layers"] == whole["layers"][3:]


def test_cli_prompts_lines_and_summary(pairs, cli, tmp_path):
    p = pairs("llama-untied")
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    result = cli("lens", p["a"], "--prompts", path, "--against", p["norm"], "--json")
    assert result.exit_code == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(lines) == 4 and lines[0]["id"] == "a"
    assert all(line["diff"]["first_divergent_layer"] == 0 for line in lines[:3])
    summary = lines[-1]
    assert summary["summary"] is True and summary["diff"]["first_divergent_layer"] == 0
    assert [row["residual_kl"] for row in summary["diff"]["layers"]] == [0.0] * 4
    table = cli("lens", p["a"], "--prompts", path, "--against", p["norm"], "--each")
    assert table.exit_code == 0, table.stderr
    assert table.stdout.count("(A) against") == 4


@pytest.mark.slow
def test_plot_draws_the_two_curves(pairs, cli, tmp_path):
    p = pairs("llama-untied")
    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPT + "\na big red\n")
    for args, out in (
        ([PROMPT], tmp_path / "one.svg"),
        (["--prompts", prompts], tmp_path / "m.png"),
    ):
        result = cli("lens", p["a"], *args, "--against", p["block"], "--plot", out)
        assert result.exit_code == 0, result.stderr
        assert f"wrote {out}" in result.stderr and out.stat().st_size > 1000
    assert "residual KL" in (tmp_path / "one.svg").read_text()


# --- a quantised copy --------------------------------------------------------------------------


def _retype() -> Callable[[Path, Path, str], dict[str, int]]:
    spec = importlib.util.spec_from_file_location("retype_gguf", ROOT / "bench" / "retype_gguf.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.retype  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def smol_q8(smollm2, tmp_path_factory) -> Path:
    """SmolLM2's weights rounded from Q4_1 to Q8_0 (its Q8_0 embedding and float norms copied)."""
    out = tmp_path_factory.mktemp("q8") / "SmolLM2-135M-Instruct.Q8_0.gguf"
    done = _retype()(smollm2, out, "Q8_0")
    assert done == {"rounded": 210, "copied": 62}
    return out


def test_a_quantised_copy_gives_a_small_nonzero_kl(smollm2, smol_q8):
    report = lens(smollm2, "The capital of France is", target=" Paris", against=smol_q8)
    kls, residual = _kls(report), _residual_kls(report)
    assert kls[0] == 0.0  # the embedding was copied, not rounded
    assert all(1e-6 < kl < 0.05 for kl in kls[1:]), kls
    assert report.diff.first_divergent_layer == 1
    # the tail (final norm, tied head) was copied: every difference is in the residual stream
    assert residual[:-1] == kls[:-1] and residual[-1] == pytest.approx(kls[-1], rel=1e-3)
    assert report.diff.against_check.ok and report.check.ok
    summary = lens_prompts(smollm2, ["The capital of France is", "One, two,"], against=smol_q8)
    assert all(0 <= row.kl < 0.05 for row in summary.diff.layers)
    assert summary.diff.layers[0].kl == 0.0 and summary.diff.first_divergent_layer == 1
    assert not math.isnan(summary.diff.layers[-1].kl)


# --- targets refused from A's GGUF ---------------------------------------------------------


def test_a_bad_target_is_refused_from_a_gguf_before_transformers_loads(
    smollm2, tmp_path, monkeypatch
):
    """lens A.gguf ... --against B: a --target (or a prompts line's) that is not one token of A's
    GGUF vocabulary is refused as without --against, from embedlens' own reading of the file,
    before torch or transformers is imported; with many prompts on both memory paths."""
    from tests.test_chat_template import _imports_of, _targets_file

    prompts = _targets_file(tmp_path / "p.jsonl", "北京")
    alone = _imports_of("lens", smollm2, "--prompts", prompts)[2]
    assert alone[0].startswith("error: line 3: --target '北京' is not a single token")
    one = _imports_of("lens", smollm2, PROMPT, "--target", "北京")[2]
    for limit in (None, "1"):  # both models at once; one after the other
        if limit is not None:
            monkeypatch.setenv("EMBEDLENS_MEMORY_LIMIT", limit)
        for args, said_alone in (
            (["--prompts", prompts], alone),
            ([PROMPT, "--target", "北京"], one),
        ):
            result, imported, said = _imports_of("lens", smollm2, *args, "--against", smollm2)
            assert (result.returncode, result.stdout, said) == (2, "", said_alone), args
            assert not imported & {"torch", "transformers"}, args
