"""docs/json.md is the JSON contract: it names every field each command's `--json` writes (at any
depth), and no field the reports do not have."""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from pathlib import Path
from typing import Any

import pytest

from embedlens.reports import Report
from embedlens.reports.addr import AddrReport
from embedlens.reports.lens import LensReport, LensSummaryReport
from embedlens.reports.neighbors import NeighborsReport
from embedlens.reports.params import ParamsReport
from embedlens.reports.tied import TiedReport
from embedlens.reports.vocab import VocabReport
from tests.test_commands import APP_COMMANDS

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "json.md").read_text(encoding="utf-8")
COMMON = "Rules every object follows"

REPORTS: dict[str, type[Report]] = {
    "params": ParamsReport,
    "tied": TiedReport,
    "neighbors": NeighborsReport,
    "addr": AddrReport,
    "lens": LensReport,
    "lens --prompts": LensSummaryReport,
    "vocab": VocabReport,
}
PER_PROMPT_LINE = frozenset({"id"})  # added to a --prompts line's lens object when its line has one

# Each command's --json run on a model (MODEL is put first); lens --prompts reads PROMPTS.
ARGS: dict[str, list[str]] = {
    "params": ["--per-block"],
    "tied": [],
    "neighbors": ["king", "king - man + woman", "-k", "2"],
    "addr": ["42", "--tokens", "16"],
    "lens": ["the king of France is", "--target", "king", "--position", "all", "-k", "2"],
    "lens --prompts": ["--prompts", "PROMPTS", "-k", "2"],
    "vocab": [],
}
PROMPTS = '{"prompt": "Hello world", "id": "first"}\n{"prompt": "The capital of France is"}\n'


def sections(doc: str) -> dict[str, set[str]]:
    """The field paths named in the first column of each section's tables, by section."""
    found: dict[str, set[str]] = {}
    for part in re.split(r"^## ", doc, flags=re.M)[1:]:
        title, _, body = part.partition("\n")
        name = title.strip().strip("`")
        found[name] = set(re.findall(r"^\| `([^`]+)` \|", body, flags=re.M))
    return found


DOCUMENTED = sections(DOC)


def _inner(hint: Any) -> list[Any]:
    """The report dataclasses a field's type holds (through lists and `| None`)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [t for a in typing.get_args(hint) for t in _inner(a)]
    if typing.get_origin(hint) is list:
        return _inner(typing.get_args(hint)[0])
    return [hint] if dataclasses.is_dataclass(hint) else []


def field_paths(cls: Any, prefix: str = "") -> set[str]:
    """Every field path of a report class: `a`, `a.b` in an object, `a[].b` in a list's items."""
    hints = typing.get_type_hints(cls)
    out = set()
    for f in dataclasses.fields(cls):
        if not f.metadata.get("json", True):  # how the report is shown, not in its JSON
            continue
        out.add(prefix + f.name)
        listed = typing.get_origin(hints[f.name]) is list or any(
            typing.get_origin(a) is list for a in typing.get_args(hints[f.name])
        )
        for inner in _inner(hints[f.name]):
            out |= field_paths(inner, f"{prefix}{f.name}{'[]' if listed else ''}.")
    return out


def json_paths(value: Any, documented: set[str], prefix: str = "") -> set[str]:
    """The field paths of a JSON object as written, going into an object or list of objects only
    where the document names fields inside it (a map such as `by_kind` is one field)."""
    out = set()
    for key, item in value.items():
        path = prefix + key
        out.add(path)
        inside = [(item, path + ".")]
        if isinstance(item, list):
            inside = [(x, path + "[].") for x in item]
        for inner, sub in inside:
            if isinstance(inner, dict) and any(d.startswith(sub) for d in documented):
                out |= json_paths(inner, documented, sub)
    return out


def test_the_document_has_a_section_for_every_command_and_report():
    assert set(REPORTS) <= set(DOCUMENTED)
    assert set(APP_COMMANDS) <= set(REPORTS)
    assert set(ARGS) == set(REPORTS)
    assert DOCUMENTED[COMMON] == {"schema_version", "command", "model"}


@pytest.mark.parametrize("section", sorted(REPORTS))
def test_the_document_names_exactly_the_reports_fields(section):
    fields = field_paths(REPORTS[section]) - {"model"}
    if section == "lens --prompts":
        fields |= PER_PROMPT_LINE
    documented = DOCUMENTED[section]
    assert sorted(fields - documented) == [], "fields docs/json.md does not name"
    assert sorted(documented - fields) == [], "names in docs/json.md that are no field"


def test_the_path_reader_sees_nested_and_listed_fields():
    paths = field_paths(NeighborsReport)
    assert {"queries", "queries[].neighbors[].cosine", "queries[].terms[].tokens[].id"} <= paths
    assert "undertrained.candidates[].input.norm_score" in field_paths(VocabReport)
    sample = {"a": {"b": 1}, "c": [{"d": 2}], "m": {"x": 1}}
    assert json_paths(sample, {"a.b", "c[].d"}) == {"a", "a.b", "c", "c[].d", "m"}
    assert sections("## `x`\n\n| field |\n|---|\n| `y` | integer | z |\n") == {"x": {"y"}}


def _outputs(cli: Any, model: Path, section: str, folder: Path) -> list[dict[str, Any]]:
    """The JSON objects the command writes on `model` (JSON Lines for lens --prompts)."""
    (folder / "prompts.jsonl").write_text(PROMPTS, encoding="utf-8")
    args = [str(folder / "prompts.jsonl") if a == "PROMPTS" else a for a in ARGS[section]]
    result = cli(section.split()[0], model, *args, "--json")
    assert result.exit_code == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def _check_output(section: str, objects: list[dict[str, Any]]) -> None:
    lens_lines, last = objects[:-1], objects[-1]
    if section == "lens --prompts":
        assert lens_lines and all(o["command"] == "lens" for o in objects)
        assert "id" in lens_lines[0] and last["summary"] is True
        for line in lens_lines:
            _names_every_field("lens", line, extra=PER_PROMPT_LINE)
    else:
        assert len(objects) == 1
    _names_every_field(section, last)


def _names_every_field(
    section: str, data: dict[str, Any], extra: frozenset[str] = frozenset()
) -> None:
    documented = DOCUMENTED[section] | DOCUMENTED[COMMON] | extra
    top = set(data)
    assert sorted(top - documented) == [], f"{section}: top-level fields not in docs/json.md"
    assert sorted(json_paths(data, documented) - documented) == [], f"{section}: nested fields"


@pytest.mark.parametrize("section", sorted(ARGS))
def test_every_field_a_command_writes_is_documented(section, cli, tiny, tmp_path):
    _check_output(section, _outputs(cli, tiny("llama-tied"), section, tmp_path))


@pytest.mark.parametrize("section", sorted(ARGS))
def test_every_field_written_on_smollm2_is_documented(section, cli, smollm2, tmp_path):
    _check_output(section, _outputs(cli, smollm2, section, tmp_path))
