"""`load=` is one kind in every public function: a `LoadOptions`. `params` and `tied` count from
the weights loaded with it; their former `load=True`/`load=False` still work, with a
DeprecationWarning, and their loading keywords work as they did."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

import embedlens
from embedlens.analysis.params import params
from embedlens.analysis.tied import tied
from embedlens.errors import UsageError
from embedlens.options import LoadOptions

RUNS = {"params": params, "tied": tied}


def test_every_public_load_is_a_load_options():
    """Each public function that takes `load=` takes a `LoadOptions` there; those without one
    read no weights with torch (neighbors, addr)."""
    taking = []
    for name in embedlens.__all__:
        value = getattr(embedlens, name)
        if inspect.isfunction(value) and "load" in inspect.signature(value).parameters:
            taking.append(name)
            annotation = str(inspect.signature(value).parameters["load"].annotation)
            assert annotation.startswith("LoadOptions"), (name, annotation)
    assert set(taking) == {"params", "tied", "lens", "lens_prompts", "lens_states"} | {
        "lens_parity",
        "lens_text",
        "tune",
        "vocab",
    }


@pytest.mark.parametrize("name", RUNS)
def test_load_options_count_as_load_true_did(cli, tiny, name):
    """One load of each spelling: LoadOptions alone, its fields as keywords on an empty one, and
    the former bool (warned) with the keywords, all give the report `--load` prints."""
    run: Any = RUNS[name]
    folder = tiny("llama-untied")
    new = run(folder, load=LoadOptions(dtype="auto")).to_dict()
    with pytest.warns(DeprecationWarning, match=rf"{name}\(load=True\) is deprecated"):
        old = run(folder, load=True).to_dict()
    assert new == old == cli.json(name, folder, "--load")
    typed = run(folder, load=LoadOptions(dtype="bfloat16")).to_dict()
    assert typed == run(folder, load=LoadOptions(), dtype="bfloat16").to_dict()
    with pytest.warns(DeprecationWarning, match="load=LoadOptions"):
        assert typed == run(folder, load=True, dtype="bfloat16").to_dict()
    assert typed == cli.json(name, folder, "--load", "--dtype", "bfloat16")
    assert typed != new


@pytest.mark.parametrize("name", RUNS)
def test_load_false_warns_and_reads_the_headers(tiny, name):
    run: Any = RUNS[name]
    folder = tiny("llama-tied")
    with pytest.warns(DeprecationWarning, match=rf"{name}\(load=False\) is deprecated"):
        old = run(folder, load=False).to_dict()
    assert old == run(folder).to_dict() == run(folder, load=None).to_dict()


@pytest.mark.parametrize("name", RUNS)
def test_load_options_with_a_conflicting_keyword_is_one_error(tiny, name):
    """A field given in `load=` and, otherwise, as a keyword: one UsageError naming each."""
    run: Any = RUNS[name]
    folder = tiny("llama-tied")
    given = LoadOptions(dtype="float16", device="cuda")
    with pytest.raises(UsageError) as raised:
        run(folder, load=given, dtype="bfloat16", device="mps", trust_remote_code=False)
    assert str(raised.value) == ("device, dtype given both in load= and as a keyword: give it once")
    with pytest.raises(UsageError, match="exclude each other"):
        run(folder, load=LoadOptions(), meta_only=True)
    with pytest.raises(UsageError, match="another model"):
        run(folder, load=LoadOptions(source="elsewhere"))
    with pytest.raises(UsageError, match=f"{name} loads the model on one device: device_map"):
        run(folder, load=LoadOptions(device_map="auto"))
    with pytest.raises(UsageError, match="expected LoadOptions, not str"):
        run(folder, load="yes")
