"""`embedlens lens --prompts`: many prompts in one load, each equal to its single run, and the
per-layer statistics checked against a plain computation from the model's hidden states."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models import TOKENIZER_LEN
from tests.test_lens import _ids, _load, reference_tail

PROMPTS = [
    "the king of France is",
    "the queen",
    "Paris is the capital city of France and Berlin is the capital of",
    "a big red dog and a small cat run to the",
    "one two three",
]
TARGETS = ["Paris", "of", "Germany", "house", "four"]
FAMILIES = ["llama-tied", "qwen3", "gpt2", "gemma2", "opt", "phi"]


def close(a: Any, b: Any, path: str = "") -> None:
    """Equal JSON values: floats to float32 rounding, everything else exactly."""
    if isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, (int, float)) and isinstance(b, (int, float)), path
        assert a == pytest.approx(b, rel=1e-4, abs=2e-6), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (path, a.keys(), b)
        for k in a:
            close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            close(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def jsonl(tmp_path: Path, rows: list[dict[str, Any]], name: str = "p.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def lines_of(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines()]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_prompt_equals_its_single_run(tiny, cli, tmp_path, family):
    """Prompts of different lengths run in one batch: each line is the single run's object."""
    folder = tiny(family)
    rows = [{"prompt": p, "target": t} for p, t in zip(PROMPTS, TARGETS, strict=True)]
    result = cli("lens", folder, "--prompts", jsonl(tmp_path, rows), "-k", "3", "--json")
    assert result.exit_code == 0, result.stderr
    out = lines_of(result.stdout)
    assert len(out) == len(PROMPTS) + 1 and out[-1]["summary"] is True
    for got, prompt, target in zip(out, PROMPTS, TARGETS, strict=False):
        single = cli.json("lens", folder, prompt, "-k", "3", "--target", target)
        close(got, single)
        assert [t["id"] for row in got["layers"] for t in row["top"]] == [
            t["id"] for row in single["layers"] for t in row["top"]
        ]


@pytest.mark.parametrize("family", ["llama-untied", "gpt-neox"])
def test_every_position_equals_the_single_run(tiny, cli, tmp_path, family):
    folder = tiny(family)
    path = tmp_path / "p.txt"
    path.write_text("\n".join(PROMPTS[:3]) + "\n", encoding="utf-8")
    result = cli("lens", folder, "--prompts", path, "--position", "all", "--json")
    assert result.exit_code == 0, result.stderr
    out = lines_of(result.stdout)
    for got, prompt in zip(out, PROMPTS[:3], strict=False):
        close(got, cli.json("lens", folder, prompt, "--position", "all"))
    assert out[-1]["n_positions"] == sum(len(_ids(folder, p)) for p in PROMPTS[:3])


def reference_stats(
    folder: Path, family: str, prompts: list[str], targets: list[str], where: str
) -> list[dict[str, float]]:
    """The summary computed plainly: hidden states through the family's tail, log_softmax,
    KL, entropy, argmax among real tokens, target probability and rank, averaged by hand."""
    from transformers import AutoTokenizer

    model = _load(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    per_layer: dict[int, dict[str, list[float]]] = {}
    for prompt, target in zip(prompts, targets, strict=True):
        ids = _ids(folder, prompt)
        tid = tok(target, add_special_tokens=False)["input_ids"][0]
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
            states = out.hidden_states
            logits = [reference_tail(model, family, states[i][0]) for i in range(len(states) - 1)]
            logits.append(out.logits[0])
        final = torch.log_softmax(out.logits[0].double(), -1)
        positions = range(len(ids)) if where == "all" else [len(ids) - 1]
        for layer, x in enumerate(logits):
            lx = torch.log_softmax(x.double(), -1)
            acc = per_layer.setdefault(layer, {k: [] for k in ("kl", "h", "agree", "p", "lp", "r")})
            for p in positions:
                acc["kl"].append(float((final[p].exp() * (final[p] - lx[p])).sum()))
                acc["h"].append(float(-(lx[p].exp() * lx[p]).sum()))
                real = x[p, :TOKENIZER_LEN]
                acc["agree"].append(
                    float(int(real.argmax()) == int(out.logits[0, p, :TOKENIZER_LEN].argmax()))
                )
                acc["p"].append(float(lx[p, tid].exp()))
                acc["lp"].append(float(lx[p, tid]))
                acc["r"].append(float(1 + (real > x[p, tid]).sum()))
    return [
        {
            "layer": layer,
            "kl": statistics.fmean(a["kl"]),
            "entropy": statistics.fmean(a["h"]),
            "top1_agreement": statistics.fmean(a["agree"]),
            "target_prob": statistics.fmean(a["p"]),
            "target_logprob": statistics.fmean(a["lp"]),
            "target_rank_median": statistics.median(a["r"]),
        }
        for layer, a in sorted(per_layer.items())
    ]


@pytest.mark.parametrize(("family", "where"), [("llama-tied", "-1"), ("gemma2", "all")])
def test_summary_equals_a_plain_computation(tiny, cli, tmp_path, family, where):
    folder = tiny(family)
    rows = [{"prompt": p, "target": t} for p, t in zip(PROMPTS, TARGETS, strict=True)]
    args = ["--prompts", jsonl(tmp_path, rows), "--position", where, "--json"]
    result = cli("lens", folder, *args)
    assert result.exit_code == 0, result.stderr
    summary = lines_of(result.stdout)[-1]
    want = reference_stats(folder, family, PROMPTS, TARGETS, where)
    n_tokens = sum(len(_ids(folder, p)) for p in PROMPTS)
    assert summary["n_prompts"] == len(PROMPTS) and summary["n_targets"] == len(PROMPTS)
    assert summary["n_positions"] == (n_tokens if where == "all" else len(PROMPTS))
    assert len(summary["layers"]) == len(want)
    for got, ref in zip(summary["layers"], want, strict=True):
        assert got["layer"] == ref["layer"]
        for key in ("kl", "entropy", "target_prob", "target_logprob"):
            assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (key, got, ref)
        assert got["top1_agreement"] == pytest.approx(ref["top1_agreement"])
        assert got["target_rank_median"] == ref["target_rank_median"]
    assert summary["layers"][-1]["kl"] == 0.0 and summary["layers"][-1]["top1_agreement"] == 1.0
    assert any(row["kl"] > 1e-3 for row in summary["layers"][:-1])  # not trivially zero


def test_summary_without_targets_has_null_target_keys(tiny, cli, tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("the king of\nthe queen of\n", encoding="utf-8")
    summary = lines_of(cli("lens", tiny("qwen3"), "--prompts", path, "--json").stdout)[-1]
    assert summary["n_targets"] == 0 and summary["n_skipped"] == 0
    row = summary["layers"][0]
    assert set(row) == {"layer", "kl", "entropy", "top1_agreement", "target_prob",
                        "target_logprob", "target_rank_median", "next_rank_median"}  # fmt: skip
    assert row["target_prob"] is None and row["target_rank_median"] is None
    assert row["next_rank_median"] is None  # the last positions: no next token


def test_position_list_reads_those_positions(tiny, cli, tmp_path):
    folder = tiny("llama-tied")
    path = tmp_path / "p.txt"
    path.write_text("the king of France is\nthe queen of Italy\n", encoding="utf-8")
    out = lines_of(cli("lens", folder, "--prompts", path, "--position", "1,3,-1", "--json").stdout)
    assert out[-1]["n_positions"] == 3 + 2 and out[-1]["position"] == [1, 3, -1]
    single = cli.json("lens", folder, "the king of France is", "--position", "all")
    assert [c["position"] for c in out[0]["grid"][0]["cells"]] == [1, 3, 4]
    close(out[0]["layers"], single["layers"])


def test_text_file_stdin_ids_and_blank_lines(tiny, cli):
    folder = tiny("llama-tied")
    stdin = '{"prompt": "the king of", "id": "k1"}\n\n{"prompt": "the queen", "id": 7}\n'
    result = cli.runner.invoke(
        __import__("embedlens.cli", fromlist=["app"]).app,
        ["lens", str(folder), "--prompts", "-", "--json"],
        input=stdin,
    )
    assert result.exit_code == 0, result.stderr
    out = lines_of(result.stdout)
    assert [o.get("id") for o in out[:2]] == ["k1", 7]
    close({k: v for k, v in out[0].items() if k != "id"}, cli.json("lens", folder, "the king of"))


def test_table_summary_and_each(tiny, cli, tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("the king of\nthe queen of\n", encoding="utf-8")
    plain = cli("lens", tiny("llama-tied"), "--prompts", path)
    assert plain.exit_code == 0 and "over 2 prompts" in plain.stdout
    assert "tokens:" not in plain.stdout
    each = cli("lens", tiny("llama-tied"), "--prompts", path, "--each")
    assert each.stdout.count("tokens:") == 2 and each.stdout.index("tokens:") < each.stdout.index(
        "over 2 prompts"
    )


# --- bad lines -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line", "says"),
    [
        ('{"prompt": "the king"}\n{"prompt": "the queen"\n', 2, "invalid JSON"),
        ('{"prompt": "the king"}\n\n{"prompt": "  "}\n', 3, "the prompt is empty"),
        ('{"prompt": "the king", "target": "of France"}\n', 1, "not a single token"),
        ('{"prompt": "the king", "promt": "x"}\n', 1, "unknown key 'promt'"),
        ('{"prompt": "the king"}\n[1, 2]\n', 2, "a JSON object is needed"),
        ('{"prompt": 3}\n', 1, "'prompt' must be given"),
        ("the king\n" * 3 + " \n", 4, "the prompt is empty"),
    ],
)
def test_bad_line_stops_before_the_model_loads(tiny, cli, tmp_path, monkeypatch, text, line, says):
    from embedlens.model import loading

    loads: list[object] = []
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: loads.append(a))
    path = tmp_path / "p.jsonl"
    path.write_text(text, encoding="utf-8")
    err = cli.fails("lens", tiny("llama-tied"), "--prompts", path, "--json", code=2)
    assert f"error: line {line}: " in err and says in err
    assert loads == []


def test_a_binary_prompts_file_is_named_in_its_error(tiny, cli, tmp_path):
    path = tmp_path / "prompts.bin"
    path.write_bytes(b"\xff\xfe\x00binary\n")
    err = cli.fails("lens", tiny("llama-tied"), "--prompts", path, code=2)
    assert f"error: --prompts '{path}' line 1: not UTF-8 text" in err


@pytest.mark.parametrize(
    ("text", "args", "says"),
    [
        (
            '{"prompt": "the king"}\n{"prompt": "the queen"}\n{"prompt": "a", "tagret": "b"}\n',
            [],
            ["error: line 3: unknown key 'tagret'", "hint: the keys are prompt, target, chat, id"],
        ),
        ("the king\nthe queen\n   \nthe man\n", [], ["error: line 3: the prompt is empty"]),
        ("{}\nnot JSON\n", ["--skip-bad"], ["error: no prompt to run: all 2 lines are bad"]),
    ],
)
def test_bad_file_is_refused_before_torch_is_imported(tiny, tmp_path, text, args, says):
    """What a file's lines show without a tokenizer is checked before torch and transformers are
    imported (15 to 33 s on a slow machine): `-X importtime` lists every module imported."""
    path = tmp_path / "p.txt"
    path.write_text(text, encoding="utf-8")
    root = str(Path(__file__).resolve().parents[1])
    paths = [root, *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "HF_HUB_OFFLINE": "1"}
    argv = ["lens", tiny("llama-tied"), "--prompts", path, *args]
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "embedlens", *map(str, argv)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    lines = result.stderr.splitlines()
    imported = {line.rsplit("|", 1)[-1].strip() for line in lines if line.startswith("import ")}
    assert (result.returncode, result.stdout) == (2, "")
    assert [line for line in lines if not line.startswith("import time:")] == says
    assert "embedlens.analysis.lens.many" in imported
    assert not imported & {"torch", "transformers", "numpy", "gguf"}


def test_position_out_of_range_for_one_line(tiny, cli, tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("the king of France is\nthe queen\n", encoding="utf-8")
    err = cli.fails("lens", tiny("llama-tied"), "--prompts", path, "--position", "3", code=2)
    assert "line 2: position 3 is out of range" in err


def test_skip_bad_goes_on_and_counts(tiny, cli, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"prompt": "the king of"}\nnot json\n{"prompt": "the queen", "target": "a b"}\n'
        '{"prompt": "the queen of"}\n',
        encoding="utf-8",
    )
    result = cli("lens", tiny("llama-tied"), "--prompts", path, "--skip-bad", "--json")
    assert result.exit_code == 0, result.stderr
    out = lines_of(result.stdout)
    assert len(out) == 3 and out[-1]["n_prompts"] == 2 and out[-1]["n_skipped"] == 2
    assert "skipped line 2: invalid JSON" in result.stderr
    assert "skipped line 3: --target 'a b' is not a single token" in result.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["the king", "--prompts", "P"], "either PROMPT or --prompts"),
        ([], "give a PROMPT, or --prompts"),
        (["--prompts", "P", "--target", "king"], "with --prompts give target and chat"),
        (["--prompts", "nope.txt"], "no such file"),
        (["--prompts", "P", "--position", "1,x"], "a list such as 3,5,-1"),
        (["--prompts", "P", "--plot", "c.pdf"], "unknown format"),
    ],
)
def test_usage_errors(tiny, cli, tmp_path, args, says):
    path = tmp_path / "p.txt"
    path.write_text("the king\n", encoding="utf-8")
    args = [str(path) if a == "P" else a for a in args]
    assert says in cli.fails("lens", tiny("llama-tied"), *args, code=2)


def test_empty_input_is_an_error(tiny, cli, tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("\n\n", encoding="utf-8")
    assert "no prompt to run" in cli.fails("lens", tiny("llama-tied"), "--prompts", path, code=2)


# --- Python ---------------------------------------------------------------------------------------


def test_python_prompts_stream_reports_and_return_the_summary(tiny, cli):
    import embedlens
    from embedlens.reports.lens import LensReport, LensSummaryReport

    folder = tiny("qwen3")
    seen: list[tuple[LensReport, Any]] = []
    prompts = ["the king of", {"prompt": "the queen", "target": "of", "id": "q"}]
    summary = embedlens.lens_prompts(
        folder, prompts, on_report=lambda report, line: seen.append((report, line))
    )
    assert isinstance(summary, LensSummaryReport) and summary.n_prompts == 2
    assert [line.id for _, line in seen] == [None, "q"]
    close(seen[0][0].to_dict(), embedlens.lens(folder, "the king of").to_dict())
    assert summary.to_dict()["summary"] is True
    # the former spelling still works for one release, with a warning
    with pytest.warns(DeprecationWarning, match="lens_prompts"):
        old = embedlens.lens(folder, prompts=prompts)
    assert old.to_json() == summary.to_json()


def test_python_prompts_on_a_loaded_model(tiny):
    from transformers import AutoTokenizer

    import embedlens

    folder = tiny("gpt2")
    model = _load(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    reports: list[Any] = []
    summary = embedlens.lens_prompts(
        model, PROMPTS, tokenizer=tok, on_report=lambda r, _line: reports.append(r)
    )
    from_files = embedlens.lens_prompts(folder, PROMPTS)
    close(summary.to_dict()["layers"], from_files.to_dict()["layers"])
    close(reports[2].to_dict()["layers"], embedlens.lens(folder, PROMPTS[2]).to_dict()["layers"])


def test_memory_stays_bounded_reports_stream(tiny, monkeypatch):
    """Prompts are read a window at a time: the first report comes before the last line is read."""
    import embedlens
    from embedlens.analysis.lens import many
    from embedlens.model.prompts import PromptSource

    monkeypatch.setattr(many, "WINDOW", 2)
    events: list[str] = []

    class Traced(PromptSource):
        def __iter__(self):  # type: ignore[no-untyped-def]
            for line in super().__iter__():
                events.append("read")
                yield line

    source = Traced(items=[f"the king of {w}" for w in ("a", "the", "a", "the", "a")])
    summary = embedlens.lens_prompts(
        tiny("llama-tied"), source, on_report=lambda _r, _line: events.append("out")
    )
    assert summary.n_prompts == 5
    second_pass = events[5:]
    assert second_pass.index("out") < len(second_pass) - 1 - second_pass[::-1].index("read")


def test_median_of_counts():
    from embedlens.analysis.lens.stats import median_of_counts

    for values in ([1], [3, 1], [5, 1, 2], [2, 2, 9, 9], [1, 1, 1, 7, 8, 100]):
        assert median_of_counts(Counter(values)) == statistics.median(values)


@pytest.mark.slow  # draws with matplotlib
def test_curves_plot(tiny, cli, tmp_path):
    pytest.importorskip("matplotlib")
    path = jsonl(
        tmp_path, [{"prompt": p, "target": t} for p, t in zip(PROMPTS, TARGETS, strict=True)]
    )
    for name in ("curves.png", "curves.svg", "curves.html"):
        out = tmp_path / name
        result = cli("lens", tiny("llama-tied"), "--prompts", path, "--plot", out)
        assert result.exit_code == 0, result.stderr
        data = out.read_bytes()
        assert len(data) > 1000
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = (tmp_path / "curves.svg").read_text(encoding="utf-8")
    assert "over 5 prompts" in svg and "median rank of the target" in svg
    page = (tmp_path / "curves.html").read_text(encoding="utf-8")
    assert "<svg" in page and "<script" not in page and "<link" not in page


def test_smollm2_prompts_equal_single_runs(smollm2, cli, tmp_path):
    """The real model, prompts of different lengths in one batch: each equals its single run."""
    prompts = ["The capital of France is", "Once upon a time, in a land far away, there lived a"]
    path = jsonl(tmp_path, [{"prompt": prompts[0], "target": " Paris"}, {"prompt": prompts[1]}])
    result = cli("lens", smollm2, "--prompts", path, "--json", "-k", "3")
    assert result.exit_code == 0, result.stderr
    out = lines_of(result.stdout)
    singles = [
        cli.json("lens", smollm2, prompts[0], "--target", " Paris", "-k", "3"),
        cli.json("lens", smollm2, prompts[1], "-k", "3"),
    ]
    for got, single in zip(out, singles, strict=False):
        assert [t["id"] for row in got["layers"] for t in row["top"]] == [
            t["id"] for row in single["layers"] for t in row["top"]
        ]
        for a, b in zip(got["layers"], single["layers"], strict=True):
            for x, y in zip(a["top"], b["top"], strict=True):
                assert x["logprob"] == pytest.approx(y["logprob"], rel=1e-3, abs=1e-3)
        assert got["check"]["ok"]
    assert out[-1]["layers"][-1]["target_prob"] == pytest.approx(
        singles[0]["layers"][-1]["target"]["prob"], rel=1e-4
    )


@pytest.mark.parametrize("bad", [float("-inf"), float("inf"), float("nan")])
def test_decoded_row_not_finite_is_refused(tiny, bad):
    """A lens row with one non-finite logit (the model's own logits finite) stops the batch run."""
    import embedlens
    from embedlens.errors import NumericError

    model = _load(tiny("llama-tied"))

    def poison(_m: Any, _args: Any, out: torch.Tensor) -> torch.Tensor:
        if out.shape[1] == 1 and out.shape[0] > 1:  # the lens's tail, not the real pass
            out = out.clone()
            out[0, 0, 3] = bad
        return out

    model.get_output_embeddings().register_forward_hook(poison)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny("llama-tied"))
    with pytest.raises(NumericError, match="decoding layer"):
        embedlens.lens_prompts(model, PROMPTS, tokenizer=tok)


def test_top_rows_ties_across_the_kth_place():
    """Equal logits across the k-th place give the lower ids first, as one row at a time does."""
    from embedlens.analysis.lens.stats import best_ids
    from embedlens.analysis.lens.stats import tops_from_log_softmax as top_rows

    x = torch.tensor([[1.0, 3.0, 2.0, 3.0, 0.0], [5.0, 1.0, 1.0, 4.0, 1.0], [0, 2, 2, 2, 9.0]])
    lx = torch.log_softmax(x, dim=-1)
    for k in (1, 2, 3, 5):
        rows = top_rows(x, lx, k, 5, [None, None, None])
        for r, top in enumerate(rows):
            kk = min(k, 5)
            kth = x[r].topk(kk).values[-1]
            assert top.ids == best_ids(x[r], kth, kk).tolist(), (k, r)


def test_batch_threads_follow_the_work_never_the_load(tiny):
    """One thread for small work, torch's own setting for large work, busy machine or not."""
    from embedlens.analysis.lens.blocks import threads_for
    from tests.busy import busy_processes

    model = _load(tiny("llama-tied"))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with busy_processes(2):
            with threads_for(model, 10**6):  # large work on a busy machine: torch's setting
                assert torch.get_num_threads() == 2
            with threads_for(model, 1):  # small work: one thread
                assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_row_sums_keep_float64_accuracy_over_a_large_vocabulary():
    """KL and entropy are sums over the whole vocabulary; over 151,936 float32 terms of a few
    hundred each they must still agree with float64 to about 1e-6 (a BLAS dot product did not)."""
    import torch

    from embedlens.analysis.lens.stats import rowdot as _rowdot

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 151_936, generator=gen) * 30
    lx = torch.log_softmax(logits, dim=-1)
    py = torch.softmax(torch.randn(4, 151_936, generator=gen) * 3, dim=-1)
    exact = (py.double() * lx.double()).sum(-1)
    got = _rowdot(py, lx).double()
    assert torch.allclose(got, exact, rtol=2e-6, atol=0), (got, exact)
