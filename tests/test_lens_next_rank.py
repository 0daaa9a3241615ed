"""The rank of the observed next token (or of --target's) at every layer: one statistic, defined
once (`stats.ROW_STATS`), in every mode's JSON. Each figure is checked exactly against plain
transformers (output_hidden_states, the final norm and the head; the last layer the model's own
logits) ranked by torch: 1 + the real tokens of a higher logit, or the same logit and a lower id.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from tests.models import TOKENIZER_LEN
from tests.test_lens import _ids
from tests.test_lens_text import CTX, changed_copy, windows_by_hand, words_text

FAMILY = "llama-untied"
PROMPTS = ["the king of France is", "the queen", "one two three four"]


def rank(row: torch.Tensor, token: int) -> int:
    """The rank of `token` among the real tokens of one row of logits."""
    real = row[:TOKENIZER_LEN]
    value = real[token]
    ids = torch.arange(TOKENIZER_LEN)
    return int((real > value).sum() + ((real == value) & (ids < token)).sum()) + 1


def layer_logits(folder: Path, ids: list[int]) -> list[torch.Tensor]:
    """Each layer's logits at every position [P, V], by plain transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
        hs = out.hidden_states
        rows = [model.lm_head(model.model.norm(h[0])) for h in hs[:-1]]
    return [*rows, out.logits[0]]


def ranks_at(folder: Path, ids: list[int], p: int, token: int | None = None) -> list[int]:
    """The rank of `token` (the next token by default) at position p, per layer."""
    t = ids[p + 1] if token is None else token
    return [rank(x[p], t) for x in layer_logits(folder, ids)]


def all_ranks(folder: Path, prompts: list[str]) -> list[list[int]]:
    """Per layer, the next token's rank at every position but each prompt's last."""
    per: list[list[int]] = []
    for prompt in prompts:
        ids = _ids(folder, prompt)
        logits = layer_logits(folder, ids)
        per.append([[rank(x[p], ids[p + 1]) for p in range(len(ids) - 1)] for x in logits])
    return [[r for one in per for r in one[i]] for i in range(len(per[0]))]


@pytest.fixture(scope="module")
def pair(tiny, tmp_path_factory) -> tuple[Path, Path]:
    folder = tiny(FAMILY)
    return folder, changed_copy(folder, tmp_path_factory.mktemp("changed"), block=2)


def test_one_prompt_rows_and_target(pair, cli):
    a, _ = pair
    ids = _ids(a, PROMPTS[0])
    data = cli.json("lens", a, PROMPTS[0], "--position", -2)
    assert [row["next_rank"] for row in data["layers"]] == ranks_at(a, ids, len(ids) - 2)
    last = cli.json("lens", a, PROMPTS[0])  # the last position has no next token
    assert all(row["next_rank"] is None for row in last["layers"])
    target = cli.json("lens", a, PROMPTS[0], "--target", "Paris")
    tid = target["target"]["id"]
    want = ranks_at(a, ids, len(ids) - 1, tid)
    assert [row["next_rank"] for row in target["layers"]] == want
    assert [row["target"]["rank"] for row in target["layers"]] == want


def test_prompts_rows_and_summary(pair, cli, tmp_path):
    a, _ = pair
    path = tmp_path / "p.txt"
    path.write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    result = cli("lens", a, "--prompts", path, "--position", "all", "--json")
    assert result.exit_code == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    summary = lines[-1]
    want = [statistics.median(r) for r in all_ranks(a, PROMPTS)]
    assert [row["next_rank_median"] for row in summary["layers"]] == want
    result = cli("lens", a, "--prompts", path, "--position", -2, "--json")
    assert result.exit_code == 0, result.stderr
    for prompt, line in zip(PROMPTS, result.stdout.splitlines(), strict=False):
        ids = _ids(a, prompt)
        rows = json.loads(line)["layers"]
        assert [row["next_rank"] for row in rows] == ranks_at(a, ids, len(ids) - 2), prompt


def test_text_table(pair, cli, tmp_path):
    from embedlens import lens_text
    from tests.test_lens_text import logits_of

    a, _ = pair
    text = words_text(tmp_path / "words.txt")
    r = lens_text(a, text, ctx=CTX)
    wins, pos = windows_by_hand(a, text.read_text(), CTX)
    logits, t = logits_of(a, wins, pos)
    for row, x in zip(r.layers, logits, strict=True):
        ranks = [rank(torch.from_numpy(x[j]), int(t[j])) for j in range(len(t))]
        assert row.next_rank_median == statistics.median(ranks), row.layer
    data = cli.json("lens", a, "--text", text, "--ctx", CTX)
    assert [row["next_rank_median"] for row in data["layers"]] == [
        x.next_rank_median for x in r.layers
    ]


def test_states_rows(pair, cli, tmp_path):
    a, _ = pair
    saved = tmp_path / "s.safetensors"
    assert cli("lens", a, PROMPTS[0], "--save-states", saved).exit_code == 0
    ids = _ids(a, PROMPTS[0])
    data = cli.json("lens", a, "--states", saved, "--position", -2)
    assert [row["next_rank"] for row in data["layers"]] == ranks_at(a, ids, len(ids) - 2)


def test_against_both_sides(pair, cli, tmp_path):
    a, b = pair
    ids = _ids(a, PROMPTS[0])
    data = cli.json("lens", a, PROMPTS[0], "--against", b, "--position", -2)
    p = len(ids) - 2
    assert [row["next_rank"] for row in data["layers"]] == ranks_at(a, ids, p)
    assert [row["against_next_rank"] for row in data["diff"]["layers"]] == ranks_at(b, ids, p)
    path = tmp_path / "p.txt"
    path.write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    result = cli("lens", a, "--prompts", path, "--against", b, "--position", "all", "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout.splitlines()[-1])
    mine = [statistics.median(r) for r in all_ranks(a, PROMPTS)]
    theirs = [statistics.median(r) for r in all_ranks(b, PROMPTS)]
    assert [row["next_rank_median"] for row in summary["layers"]] == mine
    assert [row["against_next_rank_median"] for row in summary["diff"]["layers"]] == theirs


def test_text_against_both_sides(pair, tmp_path):
    from embedlens import lens_text
    from tests.test_lens_text import logits_of

    a, b = pair
    text = words_text(tmp_path / "words.txt")
    r = lens_text(a, text, ctx=CTX, against=b)
    wins, pos = windows_by_hand(a, text.read_text(), CTX)
    assert r.pair is not None
    for side, rows, key in ((a, r.layers, "next_rank_median"),
                            (b, r.pair, "against_next_rank_median")):  # fmt: skip
        logits, t = logits_of(side, wins, pos)
        for row, x in zip(rows, logits, strict=True):
            ranks = [rank(torch.from_numpy(x[j]), int(t[j])) for j in range(len(t))]
            assert getattr(row, key) == statistics.median(ranks), (key, row.layer)
