"""`neighbors` and `addr` from Python: the same report as the command line's --json, and errors
as EmbedlensError subclasses."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from embedlens.analysis.addr import addr
from embedlens.analysis.neighbors import neighbors
from embedlens.errors import (
    CheckpointError,
    EmbedlensError,
    SourceError,
    UnsupportedError,
    UsageError,
)
from embedlens.reports.addr import AddrReport
from embedlens.reports.neighbors import NeighborsReport

# (CLI arguments after MODEL, the same call's keyword arguments for the API)
TINY_NEIGHBORS: list[tuple[list[str], dict[str, Any]]] = [
    (["king", "cat"], {"queries": ["king", "cat"]}),
    (
        ["king", "-k", "3", "--id", "7", "--id", "9"],
        {"queries": ["king"], "top_k": 3, "ids": [7, 9]},
    ),
    (["king - man + woman"], {"queries": ["king - man + woman"]}),
    (["king queen", "--pool", "mean"], {"queries": ["king queen"], "pool": "mean"}),
    (["king queen", "--pool", "last"], {"queries": ["king queen"], "pool": "last"}),
    (["king", "--matrix", "output"], {"queries": ["king"], "matrix": "output"}),
    (
        ["king", "--include-special", "-k", "54"],
        {"queries": "king", "include_special": True, "top_k": 54},
    ),
]
SMOL_NEIGHBORS: list[tuple[list[str], dict[str, Any]]] = [
    (["' king'", "cat", "北京"], {"queries": ["' king'", "cat", "北京"]}),
    (["--id", "42", "-k", "8"], {"ids": [42], "top_k": 8}),
    (["' king' - ' man' + ' woman'"], {"queries": ["' king' - ' man' + ' woman'"]}),
    (["北京", "--pool", "mean"], {"queries": ["北京"], "pool": "mean"}),
    (["' king'", "--matrix", "output"], {"queries": ["' king'"], "matrix": "output"}),
]
TINY_ADDR: list[tuple[list[str], dict[str, Any]]] = [
    (["0", "king", "71"], {"rows": [0, "king", 71]}),
    (["king", "--tokens", "16", "--tp", "8"], {"rows": "king", "tokens": 16, "tp": 8}),
    (["3", "--matrix", "output", "--no-check"], {"rows": 3, "matrix": "output", "check": False}),
]
SMOL_ADDR: list[tuple[list[str], dict[str, Any]]] = [
    (["42", " king", "北京"], {"rows": [42, " king", "北京"]}),
    (["42", "--tokens", "16384", "--tp", "4"], {"rows": [42], "tokens": 16384, "tp": 4}),
    (
        ["7", "--no-check", "--matrix", "output"],
        {"rows": ["7"], "check": False, "matrix": "output"},
    ),
]


def _same(cli, command: str, model: Path, args: list[str], report: Any) -> None:
    expected = cli.json(command, model, *args)
    assert report.to_dict() == expected


@pytest.mark.parametrize(("args", "kwargs"), TINY_NEIGHBORS)
@pytest.mark.parametrize("family", ["llama-tied", "llama-untied"])
def test_neighbors_equals_the_cli_on_a_tiny_model(cli, tiny, family, args, kwargs):
    folder = tiny(family)
    report = neighbors(str(folder), **kwargs)
    assert isinstance(report, NeighborsReport)
    _same(cli, "neighbors", folder, args, report)


@pytest.mark.slow
@pytest.mark.parametrize(("args", "kwargs"), SMOL_NEIGHBORS)
def test_neighbors_equals_the_cli_on_smollm2(cli, smollm2, args, kwargs):
    report = neighbors(str(smollm2), **kwargs)
    _same(cli, "neighbors", smollm2, args, report)
    assert report.tensor == "token_embd.weight"


@pytest.mark.parametrize(("args", "kwargs"), TINY_ADDR)
@pytest.mark.parametrize("family", ["llama-tied", "llama-untied"])
def test_addr_equals_the_cli_on_a_tiny_model(cli, tiny, family, args, kwargs):
    folder = tiny(family)
    report = addr(str(folder), **kwargs)
    assert isinstance(report, AddrReport)
    _same(cli, "addr", folder, args, report)


@pytest.mark.slow
@pytest.mark.parametrize(("args", "kwargs"), SMOL_ADDR)
def test_addr_equals_the_cli_on_smollm2(cli, smollm2, args, kwargs):
    report = addr(str(smollm2), **kwargs)
    _same(cli, "addr", smollm2, args, report)
    assert report.format == "gguf"


def test_notes_are_in_the_report_and_on_stderr(cli, tiny):
    """What the command line says on stderr is the report's notes, which --json carries too."""
    folder = tiny("llama-tied")
    report = neighbors(folder, "king", matrix="output")
    assert "the LM head is tied to the embedding: the output matrix is the input matrix" in (
        report.notes
    )
    result = cli("neighbors", folder, "king", "--matrix", "output")
    assert result.exit_code == 0
    assert result.stderr.splitlines() == ["note: " + n for n in report.notes]


def test_a_path_object_is_a_model(tiny):
    """MODEL may be an os.PathLike; the report names it as given."""
    folder = tiny("llama-tied")
    assert neighbors(folder, ["king"]).model == str(folder)
    assert addr(folder, [3]).model == str(folder)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"queries": ["king"], "top_k": 0}, "-k must be at least 1 (got 0)"),
        ({"queries": ["king"], "top_k": 55}, "-k 55 is more than the 54 rows searched"),
        ({"queries": ["king"], "matrix": "sideways"}, "unknown matrix 'sideways'"),
        ({"queries": ["king"], "pool": "middle"}, "unknown --pool 'middle'"),
        ({"queries": []}, "no query given"),
        ({"queries": ["xyzzy"]}, "'xyzzy' is not in the vocabulary"),
        ({"ids": [72]}, "row 72 is out of range"),
        ({"ids": [60]}, "row 60 is a padding row"),
        ({"queries": ["king - "]}, "cannot parse the expression"),
    ],
)
def test_neighbors_usage_errors(tiny, kwargs, says):
    with pytest.raises(UsageError) as caught:
        neighbors(tiny("llama-tied"), **kwargs)
    assert says in caught.value.message
    assert caught.value.exit_code == 2


@pytest.mark.parametrize(
    ("rows", "kwargs", "says"),
    [
        ([72], {}, "row 72 is out of range: the table has 72 rows"),
        (["-1"], {}, "row -1 is negative"),
        ([""], {}, "empty ROW"),
        ([], {}, "no ROW given"),
        (["xyzzy"], {}, "'xyzzy' is not in the vocabulary"),
        ([0], {"tp": 3}, "--tp 3 does not divide the padded vocabulary"),
        ([0], {"tp": 0}, "--tp must be at least 1"),
        ([0], {"tokens": 0}, "--tokens must be at least 1"),
        ([0], {"matrix": "middle"}, "unknown matrix 'middle'"),
    ],
)
def test_addr_usage_errors(tiny, rows, kwargs, says):
    with pytest.raises(UsageError) as caught:
        addr(tiny("llama-tied"), rows, **kwargs)
    assert says in caught.value.message


def test_errors_that_are_not_usage(tiny, tmp_path):
    """A missing model is a SourceError, a corrupt table a CheckpointError, a model without a
    tokenizer an UnsupportedError for neighbors (addr still gives rows by id, with a note)."""
    for call in (lambda m: neighbors(m, "king"), lambda m: addr(m, [3])):
        with pytest.raises(SourceError):
            call(tmp_path / "nope")
    broken = tmp_path / "truncated"
    shutil.copytree(tiny("llama-tied"), broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    for call in (lambda m: neighbors(m, "king"), lambda m: addr(m, [3])):
        with pytest.raises(CheckpointError):
            call(broken)
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(tiny("llama-tied"), bare)
    (bare / "tokenizer.json").unlink()
    with pytest.raises(UnsupportedError):
        neighbors(bare, "king")
    report = addr(bare, [3])
    assert report.rows[0].token is None
    assert any(n.startswith("tokens are not shown: ") for n in report.notes)
    with pytest.raises(UnsupportedError, match=r"has no tokenizer\.json"):
        addr(bare, ["king"])  # a row given as text needs the tokenizer: the real reason is said
    assert issubclass(UsageError, EmbedlensError)
