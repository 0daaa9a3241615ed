"""`lens` work kept proportional to what is shown: a grid's cells reduced to their top-1 whatever
-k is, and a -k past the vocabulary clamped to it with a note."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models import TOKENIZER_LEN
from tests.test_lens_prompts import PROMPTS, close, lines_of

PROMPT = "the king of France is"


def _load(folder: Path) -> tuple[Any, list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, list(AutoTokenizer.from_pretrained(folder)(PROMPT)["input_ids"])


def test_grid_cells_are_the_top1_of_a_full_run(tiny):
    """Only the position read keeps the top-k (all of the vocabulary here) and the target; every
    other cell holds the top-1 a full run gives, to the bit."""
    from embedlens.analysis.lens.engine import run_lens

    model, ids = _load(tiny("qwen3"))
    last = len(ids) - 1
    args = {"layers": [0, 1, 2, 3], "positions": list(range(len(ids))), "target": 20}
    full = run_lens(model, ids, k=4, real_vocab=TOKENIZER_LEN, **args)
    grid = run_lens(model, ids, k=TOKENIZER_LEN, real_vocab=TOKENIZER_LEN, full_at=[last], **args)
    assert grid.rows.keys() == full.rows.keys()
    for (layer, pos), top in full.rows.items():
        cell = grid.rows[(layer, pos)]
        if pos == last:
            assert len(cell.ids) == TOKENIZER_LEN and cell.ids[:4] == top.ids
            assert cell.probs[:4] == top.probs and cell.logprobs[:4] == top.logprobs
            assert (cell.target_prob, cell.target_rank) == (top.target_prob, top.target_rank)
        else:
            assert (cell.ids, cell.probs, cell.logprobs) == (
                top.ids[:1],
                top.probs[:1],
                top.logprobs[:1],
            )
            assert cell.target_rank is None


def test_batch_rows_hold_the_top_k_at_the_position_read_only(tiny):
    """`--prompts`: the rows of a prompt's other positions hold their top-1 and the target, as
    a run reading the top-k everywhere gives them."""
    from embedlens.analysis.lens.engine import BatchItem, BatchLens

    model, ids = _load(tiny("qwen3"))
    last, every = len(ids) - 1, list(range(len(ids)))

    def run(item: BatchItem) -> Any:
        return BatchLens(model, [0, 1, 2, 3], TOKENIZER_LEN, TOKENIZER_LEN).run([item])[0]

    full, read = run(BatchItem(ids, every, 20)), run(BatchItem(ids, every, 20, read=last))
    assert read.result.rows.keys() == full.result.rows.keys() and read.kl == full.kl
    for (layer, pos), top in full.result.rows.items():
        cell = read.result.rows[(layer, pos)]
        assert len(top.ids) == TOKENIZER_LEN
        if pos == last:
            assert cell == top
        else:
            assert (cell.ids, cell.probs, cell.logprobs) == (
                top.ids[:1],
                top.probs[:1],
                top.logprobs[:1],
            )
            assert (cell.target_prob, cell.target_rank, cell.target_logprob) == (
                top.target_prob,
                top.target_rank,
                top.target_logprob,
            )


@pytest.mark.parametrize("against", [False, True])
def test_prompts_run_alone_give_what_their_batch_gives(tiny, monkeypatch, against):
    """A prompt whose check fails in its batch runs again on its own (`BatchLens._alone`): with
    `--position all` it keeps and ranks every position as the batch does, so the summary (its
    next-token ranks, a target's figures) and an `--against` comparison are the batch's, to
    float32 rounding (the comparison read every position and failed with a KeyError before)."""
    import embedlens
    from embedlens.analysis.lens.engine import BatchLens

    model = tiny("llama-tied")
    prompts = [*PROMPTS[:2], {"prompt": PROMPTS[2], "target": " the"}]
    options = embedlens.LensOptions(position="all")
    kw: dict[str, Any] = {"against": model} if against else {}

    def run() -> dict[str, Any]:
        return embedlens.lens_prompts(model, prompts, options=options, **kw).to_dict()

    batch = run()
    monkeypatch.setattr(BatchLens, "_run_group", lambda lens, items: [*map(lens._alone, items)])
    alone = run()
    close(alone, batch)
    assert all(row["next_rank_median"] is not None for row in alone["layers"])
    assert alone["n_targets"] == 1 and alone["n_positions"] == 20
    if against:
        assert [row["against_next_rank_median"] for row in alone["diff"]["layers"]] == [
            row["next_rank_median"] for row in alone["layers"]
        ]


def test_a_decoded_row_that_is_not_finite_is_refused_and_an_overflowing_sum_is_not():
    from embedlens.analysis.lens.engine import check_decoded
    from embedlens.errors import NumericError

    pos = [7, 9].__getitem__
    fine = torch.full((2, 4), 3e38)  # finite logits whose sum overflows float32
    check_decoded(fine, [(2, 0), (2, 1)], pos)
    for bad in (float("inf"), float("nan")):
        out = fine.clone()
        out[1, 2] = bad
        with pytest.raises(NumericError, match="layer 2 at position 9"):
            check_decoded(out, [(2, 0), (2, 1)], pos)


# --- -k past the vocabulary ----------------------------------------------------------------------

BIG_K = "100000"
CLAMPED = (
    f"-k {BIG_K} is more than the vocabulary's {TOKENIZER_LEN:,} tokens: "
    f"showing all {TOKENIZER_LEN:,}"
)


def test_k_past_the_vocabulary_is_clamped_with_a_note(tiny, cli):
    folder = tiny("llama-tied")
    result = cli("lens", folder, PROMPT, "-k", BIG_K, "--json")
    assert result.exit_code == 0, result.stderr
    assert f"note: {CLAMPED}" in result.stderr
    data = json.loads(result.stdout)
    assert [len(row["top"]) for row in data["layers"]] == [TOKENIZER_LEN] * len(data["layers"])
    exact = cli("lens", folder, PROMPT, "-k", str(TOKENIZER_LEN), "--json")
    assert "more than the vocabulary" not in exact.stderr
    assert data["notes"] == [*json.loads(exact.stdout)["notes"], CLAMPED]
    assert {**data, "notes": []} == {**json.loads(exact.stdout), "notes": []}


def test_the_table_shows_its_runners_up_and_counts_the_rest(tiny, cli, monkeypatch):
    """-k past what a table row can show (100; 10 here, for the tiny vocabulary): the first ones
    after the top-1, in the JSON's order, then how many more; the JSON keeps every one."""
    from embedlens.views import lens as view
    from embedlens.views.format import quoted

    monkeypatch.setattr(view, "NEXT_SHOWN", 10)
    folder = tiny("llama-tied")
    data = cli.json("lens", folder, PROMPT, "-k", "31")
    result = cli("lens", folder, PROMPT, "-k", "31", env={"COLUMNS": "100000"})
    assert result.exit_code == 0, result.stderr
    lines = [ln for ln in result.stdout.splitlines() if "and 20 more (--json lists them all)" in ln]
    assert len(lines) == len(data["layers"])
    for line, layer in zip(lines, data["layers"], strict=True):
        assert len(layer["top"]) == 31
        shown = [quoted(t["token"]).plain + " " for t in layer["top"][1:11]]
        at = [line.index(t) for t in shown]  # every one there, in order
        assert at == sorted(at)
    small = cli("lens", folder, PROMPT, "-k", "11")
    assert "more (--json lists them all)" not in small.stdout


def test_prompts_with_k_past_the_vocabulary_equal_their_single_runs(tiny, cli, tmp_path):
    """Every position read, the whole vocabulary at the last: each line is its single run, and
    the note is said once."""
    folder = tiny("gpt-neox")
    path = tmp_path / "p.txt"
    path.write_text("\n".join(PROMPTS[:3]) + "\n", encoding="utf-8")
    args = ("--position", "all", "-k", BIG_K)
    result = cli("lens", folder, "--prompts", path, *args, "--json")
    assert result.exit_code == 0, result.stderr
    assert result.stderr.count(CLAMPED) == 1
    out = lines_of(result.stdout)
    for got, prompt in zip(out, PROMPTS[:3], strict=False):
        assert {len(row["top"]) for row in got["layers"]} == {TOKENIZER_LEN}
        close(got, cli.json("lens", folder, prompt, *args))


def test_summary_alone_decodes_the_top1_whatever_k_is(tiny, cli, tmp_path, monkeypatch):
    from embedlens.analysis.lens import engine as lens_batch

    asked: list[int] = []
    init = lens_batch.BatchLens.__init__

    def spy(self: Any, model: Any, layers: Any, k: int, *rest: Any, **named: Any) -> None:
        asked.append(k)
        init(self, model, layers, k, *rest, **named)

    monkeypatch.setattr(lens_batch.BatchLens, "__init__", spy)
    folder = tiny("llama-tied")
    path = tmp_path / "p.txt"
    path.write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    big = cli("lens", folder, "--prompts", path, "-k", BIG_K)
    assert big.exit_code == 0, big.stderr
    assert big.stdout == cli("lens", folder, "--prompts", path).stdout
    assert "more than the vocabulary" not in big.stderr  # nothing of the top-k is shown
    assert cli("lens", folder, "--prompts", path, "-k", "3", "--json").exit_code == 0
    assert asked == [1, 1, 3]
    assert "-k must be at least 1, not 0" in cli.fails(
        "lens", folder, "--prompts", path, "-k", "0", code=2
    )


# --- how much of a large grid the heatmap draws --------------------------------------------------


def grid_report(positions: int, layers: int) -> Any:
    """A lens report with a grid of this size (made up: the drawing's bounds need no model)."""
    from embedlens.reports.lens import (
        GridCell,
        GridRow,
        LensCheck,
        LensLayer,
        LensReport,
        Prediction,
    )
    from embedlens.reports.tokens import TokenRef

    words = ["the", " king", "中国", "\n", " international"]

    def cell(layer: int, pos: int) -> GridCell:
        p = ((7 * pos + 3 * layer) % 10 + 0.5) / 10
        return GridCell(pos, pos % 5, words[(pos + layer) % 5], p, math.log(p))

    return LensReport(
        model="made-up",
        tokens=[TokenRef(i % 5, words[i % 5]) for i in range(positions)],
        position=-1,
        position_index=positions - 1,
        num_layers=layers - 1,
        layers=[LensLayer(n, [Prediction(1, " king", 0.5, math.log(0.5))]) for n in range(layers)],
        check=LensCheck(1e-6, 1e-3, True, True, None),
        steps=["model.norm", "lm_head"],
        dtype="float32",
        vocab_size=5,
        tokenizer_size=5,
        prompt="made up",
        grid=[GridRow(n, [cell(n, p) for p in range(positions)]) for n in range(layers)],
    )


@pytest.mark.parametrize(("positions", "layers"), [(5, 4), (64, 31), (100, 20)])
def test_small_grids_are_drawn_whole(positions, layers):
    from embedlens.views.heatmap import plan

    drawn = plan(grid_report(positions, layers))
    assert drawn.whole and drawn.columns == positions and drawn.notes() == []


def test_past_the_cell_bounds_cells_are_colours_only():
    from embedlens.views.heatmap import plan

    drawn = plan(grid_report(65, 31))  # 2,015 cells
    assert not drawn.text and (drawn.group, drawn.step) == (1, 1)
    assert drawn.notes() == [
        "the heatmap of 65 positions x 31 layers (2,015 cells) is drawn without tokens and "
        "probabilities in its cells (they are drawn up to 2,000 cells and 100 positions; --json "
        "gives every cell)"
    ]
    assert not plan(grid_report(101, 2)).text  # a column too narrow for a token
    wide = plan(grid_report(400, 31))
    assert (wide.text, wide.group, wide.step) == (False, 1, 5)
    assert list(wide.labelled())[:3] == [0, 5, 10] and len(wide.labelled()) == 80
    assert wide.notes()[0].endswith("; every 5th position is labelled")


def test_past_the_column_bound_positions_share_columns():
    from embedlens.views.heatmap import plan

    drawn = plan(grid_report(5000, 2))
    assert (drawn.group, drawn.columns, drawn.step) == (3, 1667, 20)
    assert list(drawn.shown(1666)) == [4998, 4999]
    assert (
        "its positions are merged 3 to a column (1,667 columns, each the mean top-1 probability "
        "of its positions); every 20th column is labelled"
    ) in drawn.notes()[0]


def test_smollm2_grid_of_400_positions_is_drawn(smollm2, cli, tmp_path):
    """The plot that once did not finish in 110 s: 400 positions x 31 layers, colours only."""
    pytest.importorskip("matplotlib")
    prompt = ("the river runs past the old mill and the hills " * 40).strip()
    out = tmp_path / "grid.png"
    result = cli("lens", smollm2, prompt, "--position", "all", "--plot", out, "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert len(data["tokens"]) == 400 and len(data["grid"]) == 31
    assert (
        "note: the heatmap of 400 positions x 31 layers (12,400 cells) is drawn without tokens"
    ) in result.stderr
    assert out.read_bytes().startswith(b"\x89PNG")
