"""docs/json.md is the JSON contract: it names every field each command's `--json` writes (at any
depth), and no field the reports do not have; each report the package defines has its section.
The lens's three shapes (one prompt's, the `--prompts` summary's, `--text`'s) hold optional parts:
a mode's subsection (`### lens --against`, ...) names the parts it adds, each run writes exactly
the fields of its shape's table and of its mode's subsections, and a report's optional parts
(`reports.part`) are the fields its subsections name, never its table."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import pkgutil
import re
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import embedlens.reports
from embedlens.reports import PART, Report
from embedlens.reports.addr import AddrReport
from embedlens.reports.lens import LensReport, LensSummaryReport
from embedlens.reports.lens_parity import LensParityReport
from embedlens.reports.lens_text import LensTextReport
from embedlens.reports.neighbors import NeighborsReport
from embedlens.reports.params import ParamsReport
from embedlens.reports.tied import TiedReport
from embedlens.reports.tune import TuneReport
from embedlens.reports.vocab import VocabReport
from tests.conftest import Runner
from tests.test_commands import APP_COMMANDS
from tests.test_tune import words_file

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
    "lens --text": LensTextReport,
    "lens --against-states": LensParityReport,
    "tune": TuneReport,
    "vocab": VocabReport,
}
"""Each section's report (the lens's three shapes: one prompt's, the summary's, --text's)."""
STATES = "lens --states"
MODES: dict[str, tuple[str, ...]] = {
    "lens --tuned": ("lens --tuned",),
    "lens --jacobian": ("lens --jacobian",),
    "lens --against": ("lens --against",),
    "lens --site": ("lens --site",),
    "lens --against --site": ("lens --against", "lens --against --site"),
    "lens --tuned --against": ("lens --tuned", "lens --against", "lens --tuned --against"),
    "lens --states": (STATES,),
    "lens --states --site": (STATES, "lens --site", "lens --states --site"),
    "lens --states --against": (STATES, "lens --against", "lens --states --against"),
    "lens --states --against --site": (
        STATES,
        "lens --against",
        "lens --against --site",
        "lens --states --against --site",
    ),
    "lens --prompts --tuned": ("lens --prompts --tuned",),
    "lens --prompts --jacobian": ("lens --prompts --jacobian",),
    "lens --prompts --against": ("lens --prompts --against",),
    "lens --prompts --site": ("lens --prompts --site",),
    "lens --prompts --against --site": (
        "lens --prompts --against",
        "lens --prompts --against --site",
    ),
    "lens --prompts --tuned --against": (
        "lens --prompts --against",
        "lens --prompts --tuned --against",
    ),
    "lens --text --site": ("lens --text --site",),
    "tune --jacobian": ("tune --jacobian",),
    "lens --against-states --site": ("lens --against-states --site",),
}
"""Each lens mode with parts: the subsections (of its shape's section) naming the parts it holds."""
EACH_LINE = {
    "lens --prompts": "lens",
    "lens --prompts --tuned": "lens --tuned",
    "lens --prompts --jacobian": "lens --jacobian",
    "lens --prompts --against": "lens --against",
    "lens --prompts --site": "lens --site",
    "lens --prompts --against --site": "lens --against --site",
    "lens --prompts --tuned --against": "lens --tuned --against",
}
"""JSON Lines runs: the mode of each prompt's line (the summary comes last)."""
PER_PROMPT_LINE = frozenset({"id"})  # added to a --prompts line's lens object when its line has one

# Each command's --json run on a model (MODEL is put first, and stands for it in the arguments);
# PROMPTS is a prompts file, DATA a text file, OUT a new folder, TUNED a lens tune fitted to MODEL,
# STATES a states file `lens --save-states` wrote for MODEL.
ARGS: dict[str, list[str]] = {
    "params": ["--per-block"],
    "tied": [],
    "neighbors": ["king", "king - man + woman", "-k", "2"],
    "addr": ["42", "--tokens", "16"],
    "lens": ["the king of France is", "--target", "king", "--position", "all", "-k", "2"],
    "lens --prompts": ["--prompts", "PROMPTS", "-k", "2"],
    "lens --tuned": ["the king of France is", "--tuned", "TUNED", "--target", "king", "-k", "2"],
    "lens --prompts --tuned": ["--prompts", "PROMPTS", "--tuned", "TUNED", "--compare-logit"],
    "lens --jacobian": ["the king of France is", "--jacobian", "JACOBIAN", "-k", "2"],
    "lens --prompts --jacobian": [
        "--prompts",
        "PROMPTS",
        "--jacobian",
        "JACOBIAN",
        "--compare-logit",
    ],
    "lens --against": ["the king of France is", "--against", "MODEL", "--target", "king"],
    "lens --prompts --against": ["--prompts", "PROMPTS", "--against", "MODEL", "-k", "2"],
    "lens --states": ["--states", "STATES", "--target", "king", "--position", "all", "-k", "2"],
    "lens --states --site": ["--states", "SITES", "--site", "attn_out,resid_mid,mlp_out,resid"],
    "lens --states --against": ["--states", "STATES", "--against", "MODEL", "--target", "king"],
    "lens --states --against --site": [
        "--states",
        "SITES",
        "--against",
        "MODEL",
        "--site",
        "attn_out",
    ],
    "lens --site": [
        "the king of France is",
        "--site",
        "attn_out,resid_mid,mlp_out,resid",
        "--target",
        "king",
        "--position",
        "all",
        "-k",
        "2",
    ],
    "lens --prompts --site": [
        "--prompts",
        "PROMPTS",
        "--site",
        "resid_mid,mlp_out,resid",
        "-k",
        "2",
    ],
    "lens --against --site": [
        "the king of France is",
        "--against",
        "MODEL",
        "--site",
        "attn_out,resid_mid,resid",
    ],
    "lens --prompts --against --site": [
        "--prompts",
        "PROMPTS",
        "--against",
        "MODEL",
        "--site",
        "attn_out,resid_mid,resid",
    ],
    "lens --tuned --against": ["the king of France is", "--tuned", "TUNED", "--against", "MODEL"],
    "lens --prompts --tuned --against": [
        "--prompts",
        "PROMPTS",
        "--tuned",
        "TUNED",
        "--against",
        "MODEL",
    ],
    "lens --text": ["--text", "DATA", "--ctx", "16", "--max-tokens", "64", "--against", "MODEL"],
    "lens --text --site": [
        "--text",
        "DATA",
        "--ctx",
        "16",
        "--max-tokens",
        "64",
        "--site",
        "attn_out,resid_mid,mlp_out,resid",
        "--against",
        "MODEL",
    ],
    "lens --against-states": ["--against-states", "STATES", "--layers", "0,1,2"],
    "lens --against-states --site": [
        "--states",
        "SITES",
        "--against-states",
        "SITES",
        "--site",
        "attn_out,resid_mid,mlp_out",
    ],
    "tune": "--data DATA --out OUT --method affine --seq-len 32 --tokens 64 --eval-tokens 32".split(),
    "tune --jacobian": (
        "--data DATA --out OUT --method affine --seq-len 32 --tokens 64 --eval-tokens 32 "
        "--jacobian --estimator sketch --probes 8 --skip-first 4 --jacobian-tokens 32"
    ).split(),
    "vocab": [],
}
PROMPTS = '{"prompt": "Hello world", "id": "first"}\n{"prompt": "The capital of France is"}\n'


def sections(doc: str, level: str = "## ") -> dict[str, set[str]]:
    """The field paths named in the first column of each section's tables, by section (`level`
    "### ": each subsection's alone; a section's are its own table's and its subsections')."""
    found: dict[str, set[str]] = {}
    for part in re.split(f"^{level}", doc, flags=re.M)[1:]:
        title, _, body = part.partition("\n")
        body = body.split("\n## ")[0]  # a subsection ends where the next section begins
        name = title.strip().strip("`")
        found[name] = set(re.findall(r"^\| `([^`]+)` \|", body, flags=re.M))
    return found


DOCUMENTED = sections(DOC)
SUBSECTIONS = sections(DOC, "### ")
TABLES = {
    name: fields
    for part in re.split(r"^(?=## )", DOC, flags=re.M)
    for name, fields in sections(part.split("\n### ")[0]).items()
}
"""Each section's own table (without its subsections')."""


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


def shape(mode: str) -> str:
    """The section of the report a mode (a key of ARGS) writes."""
    if mode in REPORTS:
        return mode
    if mode.startswith("tune "):
        return "tune"
    if "--against-states" in mode:
        return "lens --against-states"
    return (
        "lens --text" if "--text" in mode else "lens --prompts" if "--prompts" in mode else "lens"
    )


def documented(mode: str) -> set[str]:
    """The field paths of a mode's object: its shape's table's, and its parts' subsections'."""
    return TABLES[shape(mode)].union(*(SUBSECTIONS[sub] for sub in MODES.get(mode, ())))


def report_classes() -> set[type]:
    """Every report the package defines (a `Report` in a module of `embedlens.reports`)."""
    found = set()
    for info in pkgutil.iter_modules(embedlens.reports.__path__):
        module = importlib.import_module(f"embedlens.reports.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, Report) and cls.__module__ == module.__name__:
                found.add(cls)
    return found


def test_the_document_has_a_section_for_every_command_and_report():
    assert set(REPORTS) <= set(DOCUMENTED)
    assert set(APP_COMMANDS) <= set(REPORTS)
    assert set(REPORTS.values()) == report_classes()
    assert {section: REPORTS[section].command for section in REPORTS} == {
        section: section.split()[0] for section in REPORTS
    }
    assert set(ARGS) == set(REPORTS) | set(MODES)
    assert set(SUBSECTIONS) == {sub for subs in MODES.values() for sub in subs}
    for mode, subs in MODES.items():  # a mode's subsections are in its shape's section
        section = re.search(f"^## `{shape(mode)}`$(.*?)(?=^## )", DOC, flags=re.M | re.S)
        assert section is not None and all(f"\n### `{sub}`\n" in section[1] for sub in subs)
    assert set(EACH_LINE) | set(EACH_LINE.values()) <= set(ARGS)
    assert DOCUMENTED[COMMON] == {"schema_version", "command", "model"}
    row = re.search(r"^\| `command` \|.*$", DOC, flags=re.M)
    assert row is not None and all(f"`{name}`" in row.group() for name in APP_COMMANDS)


@pytest.mark.parametrize("section", sorted(REPORTS))
def test_the_document_names_exactly_the_reports_fields(section):
    fields = field_paths(REPORTS[section]) - {"model"}
    if section == "lens --prompts":
        fields |= PER_PROMPT_LINE
    documented = DOCUMENTED[section]
    assert sorted(fields - documented) == [], "fields docs/json.md does not name"
    assert sorted(documented - fields) == [], "names in docs/json.md that are no field"
    # the optional parts are named in the subsections, every other field in the table
    parts = {f.name for f in dataclasses.fields(REPORTS[section]) if PART in f.metadata}
    top = {name for name in TABLES[section] if "." not in name} - {"model"}
    assert top == {name for name in fields if "." not in name} - parts
    subs = {sub for mode, subs in MODES.items() if shape(mode) == section for sub in subs}
    named = set().union(*(SUBSECTIONS[sub] for sub in subs))
    assert {name for name in named if "." not in name} == parts


def filled(value: dict[str, Any], prefix: str = "") -> set[str]:
    """Where a JSON object holds objects with something in them, at any depth, as the prefix of
    their fields' paths (`""` for the object itself, `a.` inside `a`, `a[].` in `a`'s items)."""
    out = {prefix} if value else set()
    for key, item in value.items():
        inside = [(x, f"{prefix}{key}[].") for x in item] if isinstance(item, list) else []
        for inner, sub in [(item, f"{prefix}{key}."), *inside]:
            if isinstance(inner, dict):
                out |= filled(inner, sub)
    return out


def test_the_path_reader_sees_nested_and_listed_fields():
    paths = field_paths(NeighborsReport)
    assert {"queries", "queries[].neighbors[].cosine", "queries[].terms[].tokens[].id"} <= paths
    assert "undertrained.candidates[].input.norm_score" in field_paths(VocabReport)
    sample = {"a": {"b": 1}, "c": [{"d": 2}], "m": {"x": 1}}
    assert json_paths(sample, {"a.b", "c[].d"}) == {"a", "a.b", "c", "c[].d", "m"}
    assert sections("## `x`\n\n| field |\n|---|\n| `y` | integer | z |\n") == {"x": {"y"}}
    empty = {"n": None, "e": [], "o": {}, "l": [{"i": {"j": 1}}, {"i": None}]}
    assert filled({**sample, **empty}) == {"", "a.", "c[].", "m.", "l[].", "l[].i."}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path, str], list[Any]]:
    """outputs(model, section) -> the JSON objects the section's run writes on `model` (JSON Lines
    for --prompts), each run once: TUNED is the lens the `tune` run wrote."""
    cli = Runner()
    done: dict[tuple[Path, str], list[Any]] = {}

    def run(model: Path, section: str) -> list[Any]:
        if (model, section) not in done:
            folder = tmp_path_factory.mktemp("json-doc")
            (folder / "prompts.jsonl").write_text(PROMPTS, encoding="utf-8")
            stands_for = {
                "PROMPTS": lambda: folder / "prompts.jsonl",
                "DATA": lambda: words_file(folder / "words.txt"),
                "OUT": lambda: folder / "lens",
                "TUNED": lambda: run(model, "tune")[0]["out"],
                "JACOBIAN": lambda: _jacobian(model, folder / "j.pt"),
                "MODEL": lambda: model,
                "STATES": lambda: _saved_states(cli, model, folder / "states.safetensors"),
                "SITES": lambda: _saved_states(cli, model, folder / "sites.safetensors", SITES),
            }
            args = [stands_for[a]() if a in stands_for else a for a in ARGS[section]]
            result = cli(section.split()[0], model, *args, "--json")
            assert result.exit_code == 0, result.stderr
            done[model, section] = [json.loads(line) for line in result.stdout.splitlines()]
        return done[model, section]

    return run


SITES = "attn_out,resid_mid,mlp_out,resid"


def _jacobian(model: Path, path: Path) -> Path:
    """A Jacobian-lens artifact for `model`: near-identity matrices at every block but the last."""
    import torch

    from embedlens.analysis.lens.jacobian import write_artifact

    sized = embedlens.params(model, meta_only=model.suffix != ".gguf")
    d, n = sized.hidden_size, sized.num_layers
    g = torch.Generator().manual_seed(0)
    matrices = {i: torch.eye(d) + 0.01 * torch.randn(d, d, generator=g) for i in range(n - 1)}
    return write_artifact(path, matrices, n_prompts=1, metadata={"target_layer": n - 1})


def _saved_states(cli: Runner, model: Path, path: Path, sites: str = "resid") -> Path:
    """A states file `lens --save-states` wrote for `model` (with the sites asked)."""
    result = cli("lens", model, "the king of France is", "--save-states", path, "--site", sites)
    assert result.exit_code == 0, result.stderr
    return path


def _check_output(section: str, objects: list[dict[str, Any]]) -> None:
    lens_lines, last = objects[:-1], objects[-1]
    each = EACH_LINE.get(section)
    if each is not None:
        assert lens_lines and all(o["command"] == "lens" for o in objects)
        assert "id" in lens_lines[0] and last["summary"] is True
        for line in lens_lines:
            _names_every_field(each, line, extra=PER_PROMPT_LINE)
    else:
        assert len(objects) == 1
    assert last["command"] == REPORTS[shape(section)].command
    _names_every_field(section, last)


def _names_every_field(
    section: str, data: dict[str, Any], extra: frozenset[str] = frozenset()
) -> None:
    """Every field the object has is documented, and every field documented is in the object
    (but those inside a null or an empty list, and a --prompts line's `id`, on some lines only)."""
    named = documented(section) | DOCUMENTED[COMMON] | extra
    top = set(data)
    assert sorted(top - named) == [], f"{section}: top-level fields not in docs/json.md"
    written = json_paths(data, named)
    assert sorted(written - named) == [], f"{section}: nested fields"
    inside = filled(data)
    expected = {p for p in named - PER_PROMPT_LINE if p[: p.rfind(".") + 1] in inside}
    assert sorted(expected - written) == [], f"{section}: documented fields the run did not write"


@pytest.mark.parametrize("section", sorted(ARGS))
def test_every_field_a_command_writes_is_documented(section, outputs, tiny):
    _check_output(section, outputs(tiny("llama-tied"), section))


@pytest.mark.parametrize("section", sorted(ARGS))
def test_every_field_written_on_smollm2_is_documented(section, outputs, smollm2):
    _check_output(section, outputs(smollm2, section))
