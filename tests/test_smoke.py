"""The fixtures work: a tiny model builds and `params` reads it."""

from tests.models import FAMILIES


def test_every_family_counts_like_transformers(tiny, cli):
    from transformers import AutoModelForCausalLM

    for family in FAMILIES:
        folder = tiny(family)
        data = cli.json("params", folder)
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert data["total"] == sum(p.numel() for p in model.parameters()), family
        assert sum(g["params"] for g in data["groups"]) == data["total"]
