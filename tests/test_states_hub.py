"""lens HUB_ID --states: a hub repo's config, tokenizer and tail read, its weights by range: the
bytes the stand-in hub sends of the weights file are the final norm's and the head's (and the
header's first range), no block's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.hubserver import FakeHub
from tests.test_hub_failures import run
from tests.test_hub_ranges import FIRST_RANGE, SMALL_FILES, WEIGHTS, _tensor

PROMPT = "the king of France is"


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny untied Llama with two 512-wide blocks (their 17 MB against a 0.2 MB head)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.models import FAMILIES, write_tokenizer

    raw = {**FAMILIES["llama-untied"], "hidden_size": 512, "intermediate_size": 1024}
    raw["num_hidden_layers"] = 2
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("wide-states")
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    write_tokenizer(folder)
    return folder


def _without_source(report: dict[str, Any]) -> dict[str, Any]:
    report = dict(report)
    report.pop("model")
    report["notes"] = [n for n in report["notes"] if " by range" not in n]
    return report


def test_a_hub_repo_s_states_read_only_the_tail_by_range(wide, cli, tmp_path):
    saved = tmp_path / "states.safetensors"
    assert cli("lens", wide, PROMPT, "--save-states", saved).exit_code == 0
    local = cli.json("lens", wide, "--states", saved, "--position", "all")
    with FakeHub(lifetime_s=600) as hub:
        hub.add("org/wide", wide)
        online = run(hub.url, tmp_path / "home", "lens", "org/wide", "--states", str(saved),
                     "--position", "all", "--json")  # fmt: skip
        assert online.returncode == 0, online.stderr
        sent = {k.split("/", 2)[2]: v for k, v in hub.sent.items() if k.startswith("org/wide/")}
    tail = [_tensor(wide, name) for name in ("model.norm.weight", "lm_head.weight")]
    read = sum(t["nbytes"] for t in tail)
    weights = sent.pop(WEIGHTS)
    assert read <= weights <= read + FIRST_RANGE, (weights, read)
    assert (wide / WEIGHTS).stat().st_size > 20 * (read + FIRST_RANGE)  # the blocks were there
    # the tokenizer's files (the chat template is one of them), and nothing else
    assert set(sent) <= {*SMALL_FILES, "special_tokens_map.json", "chat_template.jinja"}, sent
    report = json.loads(online.stdout)
    assert report["states"]["tensors_read"] == ["model.norm.weight", "lm_head.weight"]
    assert any(f"of {WEIGHTS}" in n and "by range" in n for n in report["notes"])
    assert _without_source(report) == _without_source(local)
