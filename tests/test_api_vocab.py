"""`embedlens.vocab(...)` is the `vocab` command: its to_dict() is the --json object."""

from __future__ import annotations

import pytest

import embedlens
from tests.models import TOKENIZER_LEN, VOCAB


def test_vocab_to_dict_is_the_json_object(cli, tiny):
    """As for every command, without show_all=True: the JSON always holds every row's figures."""
    folder = tiny("llama-untied")
    report = embedlens.vocab(str(folder))
    assert isinstance(report, embedlens.Report)
    assert report.to_dict() == cli.json("vocab", folder)
    assert report.layout.padding_rows == VOCAB - TOKENIZER_LEN
    scan = report.to_dict()["undertrained"]
    assert len(scan["indicators"]) == len(scan["norms"]) == VOCAB
    # show_all=True (--all) lists every candidate in the tables; the JSON is the same.
    every = embedlens.vocab(str(folder), show_all=True)
    assert every.to_dict() == report.to_dict() == cli.json("vocab", folder, "--all")
    assert "shows_all" not in report.to_dict()


def test_vocab_all_lists_every_candidate_in_the_tables(cli, smollm2):
    """--all (show_all=True) changes the tables only: SmolLM2's 59 candidates, 15 shown without it."""
    import io

    from rich.console import Console

    report = embedlens.vocab(str(smollm2), show_all=True)
    buffer = io.StringIO()
    Console(file=buffer, width=140, color_system=None, highlight=False).print(report)
    assert buffer.getvalue() == cli("vocab", smollm2, "--all").stdout
    assert "more (--all)" not in buffer.getvalue()
    assert "│ 59 │" in buffer.getvalue()
    assert "... 44 more (--all)" in cli("vocab", smollm2).stdout
    assert report.to_dict() == cli.json("vocab", smollm2)


def test_vocab_against_is_the_json_object(cli, tiny):
    folder = tiny("llama-tied")
    other = str(tiny("llama-untied") / "tokenizer.json")
    report = embedlens.vocab(str(folder), against=other)
    assert report.to_dict() == cli.json("vocab", folder, "--against", other)
    assert report.against is not None and report.against.identical


def test_vocab_refuses_a_loaded_model(tiny):
    with pytest.raises(embedlens.UsageError, match="vocab reads MODEL from its files"):
        embedlens.vocab(object())  # type: ignore[arg-type]
    with pytest.raises(embedlens.UsageError, match="--max-verify must be at least 1"):
        embedlens.vocab(str(tiny("llama-tied")), max_verify=0)


def test_vocab_takes_load_as_the_lens_and_params_do(tiny):
    """`load=` (a `LoadOptions`) holds the loading keywords: the same report as the keywords,
    the model checked with `check_fit=` loaded as it says; a field given both ways, another
    model's source and a loading over devices are refused, as `params` refuses them."""
    folder = str(tiny("llama-tied"))
    by_keywords = embedlens.vocab(folder, check_fit=True, dtype="bfloat16").to_dict()
    loaded = embedlens.LoadOptions(dtype="bfloat16")
    assert embedlens.vocab(folder, check_fit=True, load=loaded).to_dict() == by_keywords
    assert embedlens.vocab(folder, check_fit=True).to_dict()["fit"] != by_keywords["fit"]
    with pytest.raises(embedlens.UsageError, match="dtype given both"):
        embedlens.vocab(folder, load=embedlens.LoadOptions(dtype="bfloat16"), dtype="float16")
    with pytest.raises(embedlens.UsageError, match="names another model"):
        embedlens.vocab(folder, load=embedlens.LoadOptions(source="elsewhere"))
    with pytest.raises(embedlens.UsageError, match="one device: device_map do not apply"):
        embedlens.vocab(folder, load=embedlens.LoadOptions(device_map="auto"))
    with pytest.raises(embedlens.UsageError, match="float13"):
        embedlens.vocab(folder, check_fit=True, load=embedlens.LoadOptions(dtype="float13"))
