"""The lens API's option objects (`LoadOptions`, `LensOptions`), the progress protocol and the
names given up for clearer ones (each -> on_report, tune's eval -> eval_data): the objects give
what the keywords give, a field given both ways is refused, the old names still work but warn."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import pytest

import embedlens
from embedlens.errors import UsageError
from embedlens.options import LENS_FIELDS, LOAD_FIELDS, LensOptions, LoadOptions
from embedlens.progress import progress_of

PROMPT = "the king of France is"
PROMPTS = ["the king of France is", "a big red", "the capital city of Italy is Rome"]


def test_the_objects_are_public_and_keywords_name_their_fields() -> None:
    assert embedlens.LoadOptions is LoadOptions and embedlens.LensOptions is LensOptions
    assert {"LoadOptions", "LensOptions"} <= set(embedlens.__all__)
    assert {f.name for f in dataclasses.fields(LoadOptions)} - {"source"} == LOAD_FIELDS
    assert "source" not in LOAD_FIELDS and "tuned" in LENS_FIELDS
    assert LoadOptions().given() == dict.fromkeys(LOAD_FIELDS, False)
    assert LoadOptions(dtype="bfloat16", device_map="auto").given() == {
        **dict.fromkeys(LOAD_FIELDS, False),
        "dtype": True,
        "device_map": True,
    }


def test_objects_and_keywords_give_the_same_report(tiny: Any) -> None:
    folder = tiny("llama-tied")
    by_keywords = embedlens.lens(folder, PROMPT, layers="0,2:", top_k=3, dtype="float32")
    by_objects = embedlens.lens(
        folder,
        PROMPT,
        load=LoadOptions(dtype="float32"),
        options=LensOptions(layers="0,2:", top_k=3),
    )
    as_model = embedlens.lens(LoadOptions(source=folder), PROMPT, layers="0,2:", top_k=3)
    mixed = embedlens.lens(folder, PROMPT, options=LensOptions(layers="0,2:"), top_k=3)
    want = by_keywords.to_json()
    assert by_objects.to_json() == want
    assert as_model.to_json() == want
    assert mixed.to_json() == want


def test_a_field_given_twice_or_unknown_is_refused(tiny: Any) -> None:
    folder = tiny("llama-tied")
    with pytest.raises(UsageError, match="top_k given both in options= and as a keyword"):
        embedlens.lens(folder, PROMPT, options=LensOptions(top_k=3), top_k=4)
    with pytest.raises(UsageError, match="dtype given both in load="):
        embedlens.lens(folder, PROMPT, load=LoadOptions(dtype="float16"), dtype="bfloat16")
    with pytest.raises(UsageError, match="names another model"):
        embedlens.lens(folder, PROMPT, load=LoadOptions(source="elsewhere"))
    with pytest.raises(UsageError, match="given twice"):
        embedlens.lens(LoadOptions(source=folder), PROMPT, load=LoadOptions())
    with pytest.raises(TypeError, match="unexpected keyword argument 'top'"):
        embedlens.lens(folder, PROMPT, top=3)
    with pytest.raises(UsageError, match="--compare-logit applies to --prompts"):
        embedlens.lens(folder, PROMPT, compare_logit=True)
    with pytest.raises(UsageError, match="--target, --chat and --grid apply to one prompt"):
        embedlens.lens_prompts(folder, PROMPTS, options=LensOptions(target="Paris"))
    with pytest.raises(UsageError, match="chat does not apply to lens_states"):
        embedlens.lens_states(folder, "states.safetensors", chat="hi")


def test_on_report_and_progress_and_the_former_each(tiny: Any) -> None:
    folder = tiny("llama-tied")
    seen: list[str] = []
    told: list[tuple[str, int, int, str]] = []

    def progress(stage: str, done: int, total: int, unit: str, detail: str = "") -> None:
        told.append((stage, done, total, unit))

    summary = embedlens.lens_prompts(
        folder, PROMPTS, on_report=lambda r, line: seen.append(r.prompt), progress=progress
    )
    assert seen == PROMPTS and summary.n_prompts == 3
    assert told == [("prompts", 3, 0, "prompts")]
    old: list[str] = []
    with pytest.warns(DeprecationWarning, match="each=.* deprecated"):
        again = embedlens.lens_prompts(folder, PROMPTS, each=lambda r, _: old.append(r.prompt))
    assert old == PROMPTS and again.to_json() == summary.to_json()
    with pytest.raises(UsageError, match="on_report= alone"):
        embedlens.lens_prompts(folder, PROMPTS, on_report=print, each=print)


def test_the_former_progress_shape_and_eval_name_warn(tmp_path: Path) -> None:
    calls: list[tuple[Any, ...]] = []

    def old(phase: str, done: int, total: int, detail: str) -> None:
        calls.append((phase, done, total, detail))

    with pytest.warns(DeprecationWarning, match="four parameters"):
        shown = progress_of(old, "tune")
    shown("refining", 1, 2, "steps", "KL by layers")
    assert calls == [("refining", 1, 2, "KL by layers")]

    def new(stage: str, done: int, total: int, unit: str, detail: str = "") -> None:
        calls.append((stage, unit))

    def renamed(_stage: str, done: int, total: int, _unit: str, _detail: str = "") -> None:
        calls.append((done, total))

    with warnings.catch_warnings():  # the protocol's parameters are positional: any names
        warnings.simplefilter("error")
        assert progress_of(new, "tune") is new
        assert progress_of(renamed, "lens_text") is renamed
    missing = tmp_path / "missing.txt"
    with pytest.warns(DeprecationWarning, match="eval_data"), pytest.raises(UsageError):
        embedlens.tune("m", missing, tmp_path / "out", eval=missing)
    with pytest.raises(UsageError, match="eval_data= alone"):
        embedlens.tune("m", missing, tmp_path / "out", eval=missing, eval_data=missing)
    data = tmp_path / "data.txt"
    data.write_text("the king of France is Paris. " * 4000)
    with pytest.raises(UsageError, match="tune loads the model on one device: device_map"):
        embedlens.tune("m", data, tmp_path / "out", device_map="auto")
