"""`embedlens.vocab(...)` is the `vocab` command: its to_dict() is the --json object."""

from __future__ import annotations

import pytest

import embedlens
from tests.models import TOKENIZER_LEN, VOCAB


def test_vocab_to_dict_is_the_json_object(cli, tiny):
    folder = tiny("llama-untied")
    report = embedlens.vocab(str(folder), all=True)
    assert isinstance(report, embedlens.Report)
    assert report.to_dict() == cli.json("vocab", folder)
    assert report.layout.padding_rows == VOCAB - TOKENIZER_LEN
    # Without all (the command's --all, implied by --json) the per-row lists are left out.
    plain = embedlens.vocab(str(folder)).to_dict()["undertrained"]
    assert plain["indicators"] is None and plain["norms"] is None


def test_vocab_against_is_the_json_object(cli, tiny):
    folder = tiny("llama-tied")
    other = str(tiny("llama-untied") / "tokenizer.json")
    report = embedlens.vocab(str(folder), against=other, all=True)
    assert report.to_dict() == cli.json("vocab", folder, "--against", other)
    assert report.against is not None and report.against.identical


def test_vocab_refuses_a_loaded_model(tiny):
    with pytest.raises(embedlens.UsageError, match="vocab reads MODEL from its files"):
        embedlens.vocab(object())  # type: ignore[arg-type]
    with pytest.raises(embedlens.UsageError, match="--max-verify must be at least 1"):
        embedlens.vocab(str(tiny("llama-tied")), max_verify=0)
