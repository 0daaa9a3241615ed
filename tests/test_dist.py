"""Runs split over processes under torchrun: two processes with gloo on the CPU give what one
gives (`lens --prompts`: the per-prompt lines byte for byte, the summary up to the order of float
sums; `tune`: the translators within 1e-4), a process that fails ends the whole run within a
minute with one `error:` line from rank 0, and a run alone never imports the distributed module.

The torchrun runs are whole processes (slow: each starts torch twice); the sums they rely on are
checked here in-process too.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import release_note
from tests.models import WORDS
from tests.test_tune import words_file

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--tokens", "1024", "--eval-tokens", "256", "--refine-tokens", "512", "--steps", "8"]


def _env() -> dict[str, str]:
    """The worktree first on the path (`python -m` also puts the cwd, ROOT, first), quiet
    progress, and nothing of an outer torchrun."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["EMBEDLENS_PROGRESS_SECONDS"] = "0"
    return env


def torchrun(*args: Any, script: str | None = None) -> subprocess.CompletedProcess[str]:
    """`torchrun --nproc-per-node 2 --standalone -m embedlens ARGS` (or, with `script`, a bash
    script each process runs, with $RANK set)."""
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--standalone",
    ]
    if script is not None:
        argv = [*launch, "--no-python", "bash", "-c", script]
    else:
        argv = [*launch, "-m", "embedlens", *(str(a) for a in args)]
    return subprocess.run(
        argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300, check=False
    )


def prompts_file(path: Path, n: int = 150) -> Path:
    """n JSON Lines prompts of the tiny models' words (ids, a target on every third), two of
    them bad: three windows of 64 good ones, so that rank 1 runs one."""
    rng = random.Random(1)
    rows: list[dict[str, Any]] = []
    for i in range(n):
        row: dict[str, Any] = {
            "prompt": " ".join(rng.choices(WORDS, k=rng.randint(2, 12))),
            "id": i,
        }
        if i % 3 == 0:
            row["target"] = " " + rng.choice(WORDS[:30])
        rows.append(row)
    rows[10] = {"prompt": ""}
    rows[100] = {"prompt": "the king", "bogus": 1}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def relative(a: float | None, b: float | None) -> float:
    if a is None or b is None:
        assert a is b
        return 0.0
    return abs(a - b) / max(abs(a), abs(b), 1e-300)


# --- lens --prompts -----------------------------------------------------------------------


@pytest.mark.slow
def test_lens_prompts_over_two_processes_prints_what_one_prints(tiny, cli, tmp_path):
    folder = tiny("llama-tied")
    path = prompts_file(tmp_path / "p.jsonl")
    args = ["lens", folder, "--prompts", path, "--json", "--skip-bad", "-k", "3"]
    one = cli(*args)
    assert one.exit_code == 0, one.stderr
    two = torchrun(*args)
    assert two.returncode == 0, two.stderr
    alone, split = one.stdout.splitlines(), two.stdout.splitlines()
    assert len(split) == len(alone) == 149
    assert split[:-1] == alone[:-1]  # every prompt's line, byte for byte, in input order
    a, b = json.loads(alone[-1]), json.loads(split[-1])
    for key in ("n_prompts", "n_positions", "n_skipped", "n_targets", "position", "num_layers"):
        assert a[key] == b[key], key
    assert a["n_skipped"] == 2 and a["n_prompts"] == 148
    for row_a, row_b in zip(a["layers"], b["layers"], strict=True):
        assert row_a["layer"] == row_b["layer"]
        for key in ("kl", "entropy", "top1_agreement", "target_prob", "target_logprob"):
            assert relative(row_a[key], row_b[key]) <= 1e-6, (row_a, row_b)
        assert row_a["target_rank_median"] == row_b["target_rank_median"]
    assert b["notes"][:2] == a["notes"] and "rank 0: 2, rank 1: 1" in b["notes"][2]
    said = two.stderr.splitlines()
    notes = [line for line in said if line.startswith("note: ") and not release_note(line)]
    assert notes == [f"note: {text}" for text in b["notes"]]  # rank 0's alone, once each


def test_statistics_of_two_shares_add_up_to_those_of_all(tiny):
    """What the processes' statistics are merged with: the shares' sums added give the
    statistics of every prompt, up to the order of float sums."""
    from embedlens import lens_prompts
    from embedlens.analysis.lens import many
    from embedlens.analysis.lens.many import LensStats

    rng = random.Random(3)
    prompts = [{"prompt": " ".join(rng.choices(WORDS, k=5)), "target": " king"} for _ in range(9)]
    kept: list[LensStats] = []
    summary = many.ManyRun.summary

    def keep(self: Any, n_bad: int, bad: list[Any]) -> Any:
        kept.append(self.stats)
        return summary(self, n_bad, bad)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(many.ManyRun, "summary", keep)
        whole = lens_prompts(tiny("llama-tied"), prompts, position="all")
        parts = [
            lens_prompts(tiny("llama-tied"), p, position="all") for p in (prompts[:4], prompts[4:])
        ]
    merged = LensStats.merged(kept[1:]).summary()
    assert sum(p.n_positions for p in parts) == whole.n_positions == kept[0].n_positions
    assert [r.layer for r in merged] == [r.layer for r in whole.layers]
    for a, b in zip(merged, whole.layers, strict=True):
        assert a.top1_agreement == b.top1_agreement and a.target_rank_median == b.target_rank_median
        for key in ("kl", "entropy", "target_prob", "target_logprob"):
            assert relative(getattr(a, key), getattr(b, key)) <= 1e-12, key


# --- tune -------------------------------------------------------------------------------------


def peaked(folder: Path, out: Path) -> Path:
    """The tiny model with its weights scaled up (the embedding 10x, other matrices 3x): its
    outputs are peaked enough that the KL refinement clearly beats least squares at every layer
    (by 1.7 to 3.7% of the check rows' KL), so a split run's refinement shows in its lens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(10.0 if "embed" in name else 3.0)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder).save_pretrained(out)
    return out


@pytest.mark.slow
def test_tune_over_two_processes_fits_what_one_fits(tiny, tmp_path):
    from safetensors.torch import load_file

    from embedlens import tune

    folder = peaked(tiny("llama-tied"), tmp_path / "peaked")
    data = words_file(tmp_path / "words.txt")
    one = tune(folder, data, tmp_path / "one", tokens=1024, eval_tokens=256, refine_tokens=512,
               steps=8).to_dict()  # fmt: skip
    two = torchrun("tune", folder, "--data", data, "--out", tmp_path / "two", *SMALL, "--json")
    assert two.returncode == 0, two.stderr
    split = json.loads(two.stdout)  # rank 0's report alone
    assert one["refined_layers"] == split["refined_layers"] == [0, 1, 2]
    a, b = (
        load_file(tmp_path / "one" / "params.safetensors"),
        load_file(tmp_path / "two" / "params.safetensors"),
    )
    assert a.keys() == b.keys()
    for key in a:
        worst = float((a[key] - b[key]).abs().max() / a[key].abs().max())
        assert worst <= 1e-4, (key, worst)
    for row_a, row_b in zip(one["layers"], split["layers"], strict=True):
        for key, value in row_a.items():
            assert relative(value, row_b[key]) <= 1e-4, (key, row_a, row_b)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "peaked", "two", "words.txt"]
    assert "split over 2 processes (torchrun, gloo)" in split["notes"][-1]


def test_least_squares_sums_of_two_shares_add_up(tiny, tmp_path):
    """The fit's sums over two shares of the sequences, taken with one shift (rank 0's) and
    added, solve to the translators of the sums over all of them: the running sums are float64,
    so only their order's last bits differ (float32 sums moved SmolLM2's translators by 7e-4)."""
    import torch

    from embedlens.analysis.tune.run import LeastSquares

    torch.manual_seed(0)
    batches = [{i: torch.randn(64, 16) * (1 + i) + i for i in range(4)} for _ in range(6)]
    whole = LeastSquares(3, 16)
    for batch in batches:
        whole.add(batch)
    shift = LeastSquares.means(batches[0], 3)
    parts = [LeastSquares(3, 16, shift=shift) for _ in range(2)]
    for s, batch in enumerate(batches):
        parts[s % 2].add(batch)
    other = parts[1]  # what the all-reduce adds to rank 0's sums, in the order reduce gives them
    theirs = iter([torch.tensor([float(other.n)], dtype=torch.float64), other.sum_x, other.sum_y,
                   other.xx, other.xy])  # fmt: skip
    parts[0].reduce(lambda total: total.add_(next(theirs)))
    assert parts[0].n == whole.n == 6 * 64
    a, b = whole.solve(), parts[0].solve()
    assert float((a.weight - b.weight).abs().max() / a.weight.abs().max()) <= 1e-9
    assert float((a.bias - b.bias).abs().max() / a.bias.abs().max()) <= 1e-9


def test_a_refined_translator_needs_more_than_rounding():
    from embedlens.analysis.tune.run import _better

    assert _better(1.0, 0.99) and not _better(1.0, 1.0 - 1e-6) and not _better(1.0, 1.0)
    assert not _better(3e-8, 1e-8) and not _better(-3e-8, -5e-8)  # rounding around a KL of 0


# --- failures ---------------------------------------------------------------------------------

FAILING = {
    "lens": 'M=$TINY; [ "$RANK" = 1 ] && M=$TINY-not-here; exec {py} -m embedlens lens "$M" '
    "--prompts $PROMPTS --json --skip-bad",
    "tune": 'D=$DATA; [ "$RANK" = 1 ] && D=$DATA-not-here; exec {py} -m embedlens tune $TINY '
    '--data "$D" --out $OUT --tokens 1024 --eval-tokens 256 --steps 2',
}


def own_frames(stderr: str) -> list[str]:
    """The traceback lines of stderr that name a file of the embedlens package: the one imported
    here (its `__file__`) or the one the processes import (ROOT's), by where the file is, not by
    a path's text (the folder the project sits in, and a venv inside it that torchrun's own
    traceback names, may be called embedlens too)."""
    import embedlens

    packages = {Path(embedlens.__file__).resolve().parent, (ROOT / "embedlens").resolve()}
    found = []
    for line in stderr.splitlines():
        named = re.match(r'\s*File "([^"]+)"', line)
        if named is not None and packages & set(Path(named.group(1)).resolve().parents):
            found.append(line)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(FAILING))
def test_a_process_that_fails_ends_the_run_with_one_error_from_rank_0(tiny, tmp_path, command):
    """Rank 1 is given a file that is not there: the run ends (non-zero) within a minute, with
    one `error:` line, rank 0's, naming rank 1 and its file; no traceback of embedlens', no
    output, no lens folder."""
    folder = tiny("llama-tied")
    values = {
        "TINY": str(folder),
        "PROMPTS": str(prompts_file(tmp_path / "p.jsonl")),
        "DATA": str(words_file(tmp_path / "w.txt")),
        "OUT": str(tmp_path / "lens"),
    }
    script = "".join(f"{k}='{v}'; " for k, v in values.items())
    script += FAILING[command].format(py=sys.executable)
    start = time.monotonic()
    result = torchrun(script=script)
    took = time.monotonic() - start
    assert result.returncode != 0 and took < 60, (result.returncode, took, result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 1: "), result.stderr
    assert "-not-here" in errors[0]
    assert result.stdout == "" and not (tmp_path / "lens").exists()
    assert not own_frames(result.stderr), result.stderr


def test_own_frames_are_the_packages_files_whatever_the_folders_name(tmp_path):
    import embedlens

    package = Path(embedlens.__file__).resolve().parent
    venv = tmp_path / "embedlens" / ".venv" / "lib" / "torch" / "distributed" / "run.py"
    stderr = (
        "Traceback (most recent call last):\n"
        f'  File "{venv}", line 9, in <module>\n'
        f'  File "{package.parent / "tests" / "test_dist.py"}", line 1, in f\n'
        f'  File "{package / "cli" / "__init__.py"}", line 151, in main\n'
        "error: rank 1: embedlens/ is not a model\n"
    )
    assert own_frames(stderr) == [stderr.splitlines()[3]]


def test_commands_that_do_not_split_are_refused_under_torchrun(tiny, cli, tmp_path):
    """Without starting anything: a command that runs in one process is one error (exit 2)
    from rank 0, none from the others, before any file is read."""
    env = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    folder = tiny("llama-tied")
    says = cli.fails("params", folder, code=2, env=env)
    assert "splits only `lens --prompts` and `tune`" in says
    says = cli.fails("lens", folder, "the king", code=2, env=env)
    assert "splits only" in says
    quiet = cli("params", folder, env={**env, "RANK": "1"})
    assert quiet.exit_code == 2 and quiet.stderr == ""  # rank 0 says it, once


# --- alone ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_alone_the_distributed_module_is_never_imported(tiny, tmp_path):
    """Without WORLD_SIZE (and with WORLD_SIZE=1), lens --prompts and tune run as before: no
    store, no process group, `embedlens.analysis.dist` not imported. (`import torch` itself
    imports torch.distributed's Python package in torch 2.x; what is never made is a group.)"""
    code = (
        "import sys, embedlens, torch.distributed as d\n"
        "embedlens.lens_prompts(sys.argv[1], ['the king of France is'])\n"
        "embedlens.tune(sys.argv[1], sys.argv[2], sys.argv[3], tokens=256, eval_tokens=64, steps=1)\n"
        "print('embedlens.analysis.dist' in sys.modules, d.is_initialized(), "
        "'torch.distributed.run' in sys.modules)\n"
    )
    data = words_file(tmp_path / "w.txt")
    for size in (None, "1"):
        env = _env()
        if size is not None:
            env["WORLD_SIZE"] = size
        out = tmp_path / f"lens-{size}"
        argv = [sys.executable, "-c", code, str(tiny("llama-tied")), str(data), str(out)]
        result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == ["False", "False", "False"]


def test_world_reads_torchruns_variables(monkeypatch):
    from embedlens.runtime import world

    for size, rank, expected in [
        (None, None, (0, 1)),
        ("1", "0", (0, 1)),
        ("2", "1", (1, 2)),
        ("4", "3", (3, 4)),
        ("two", "0", (0, 1)),
        ("2", "2", (0, 1)),
    ]:
        for name, value in (("WORLD_SIZE", size), ("RANK", rank)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        assert world() == expected, (size, rank)
