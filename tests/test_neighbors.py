"""`neighbors`: exact lists on the real SmolLM2, known geometry on hand-set rows, bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.models import SPECIALS, TOKENIZER_LEN, VOCAB, WORDS, hub_cache
from tests.smol_reference import plain_neighbors, smol_table

REFERENCE = {  # shared/REFERENCE.md, measured with transformers
    " king": [" King", "King", " kings", " queen", " Queen"],
    " cat": [" Cat", "Cat", "cat", " cats", " dog"],
}
ID = {t: i for i, t in enumerate(SPECIALS + WORDS)}
D = 32  # hidden size of the tiny llama fixtures


# --- the real model --------------------------------------------------------------------------


def test_smollm2_king_and_cat_match_the_reference(cli, smollm2):
    data = cli.json("neighbors", smollm2, " king", " cat")
    assert data["command"] == "neighbors" and data["model"] == str(smollm2)
    assert data["k"] == 5 and data["matrix"] == "input"
    ref = smol_table(smollm2)
    allowed = np.ones(len(ref.rows), dtype=bool)
    allowed[ref.control] = False
    assert data["searched_rows"] == int(allowed.sum()) == 49152 - 17
    for q in data["queries"]:
        assert [n["token"] for n in q["neighbors"]] == REFERENCE[q["query"]]
        assert q["tokens"] == [{"id": q["token_id"], "token": q["query"]}]
        assert ref.tokens[q["token_id"]] == "Ġ" + q["query"].strip()
        mask = allowed.copy()
        mask[q["token_id"]] = False
        expected = plain_neighbors(ref.rows, mask, ref.rows[q["token_id"]], 5)
        assert [n["id"] for n in q["neighbors"]] == expected
        unit = ref.rows / np.linalg.norm(ref.rows, axis=1, keepdims=True)
        for n in q["neighbors"]:
            assert n["cosine"] == pytest.approx(
                float(unit[n["id"]] @ unit[q["token_id"]]), abs=1e-5
            )


def test_smollm2_analogy_and_split_word(cli, smollm2):
    data = cli.json(
        "neighbors", smollm2, "' king' - ' man' + ' woman'", " Beijing", "北京", "-k", 3
    )
    analogy, beijing, split = data["queries"]
    assert analogy["kind"] == "expression" and analogy["token_id"] is None
    assert [(t["sign"], t["token"]) for t in analogy["terms"]] == [
        (1, " king"),
        (-1, " man"),
        (1, " woman"),
    ]
    ref = smol_table(smollm2)
    unit = ref.rows / np.linalg.norm(ref.rows, axis=1, keepdims=True)
    ids = [t["token_id"] for t in analogy["terms"]]
    combined = unit[ids[0]] - unit[ids[1]] + unit[ids[2]]
    allowed = np.ones(len(ref.rows), dtype=bool)
    allowed[ref.control + ids] = False
    assert [n["id"] for n in analogy["neighbors"]] == plain_neighbors(
        ref.rows, allowed, combined, 3
    )
    assert analogy["neighbors"][0]["token"] == " queen"
    assert beijing["split"] is False and beijing["neighbors"][0]["token"] == " Seoul"
    # '北京' is four byte-level tokens, none of them valid UTF-8 alone: shown by bytes.
    assert split["split"] is True and len(split["tokens"]) == 4
    assert split["token"] == "\\xe5\\x8c" and "\ufffd" not in json.dumps(data)
    shown = cli("neighbors", smollm2, "北京", "-k", 1)
    assert "splits into 4 tokens" in shown.stderr and "the first (" in shown.stderr


# --- hand-set geometry -----------------------------------------------------------------------


def _unit(*dims: tuple[int, float]) -> np.ndarray:
    v = np.zeros(D, dtype=np.float32)
    for i, x in dims:
        v[i] = x
    return v


ROYAL, MALE, FEMALE, PERSON, YOUNG = range(5)
KING = _unit((ROYAL, 2), (MALE, 1))
HAND_SET = {
    "king": KING,
    "queen": _unit((ROYAL, 2), (FEMALE, 1)),
    "man": _unit((PERSON, 1), (MALE, 1)),
    "woman": _unit((PERSON, 1), (FEMALE, 1)),
    "prince": _unit((ROYAL, 2), (MALE, 1), (YOUNG, 1.5)),
    "princess": _unit((ROYAL, 2), (FEMALE, 1), (YOUNG, 1.5)),
    "boy": _unit((PERSON, 1), (MALE, 1), (YOUNG, 1.5)),
    "girl": _unit((PERSON, 1), (FEMALE, 1), (YOUNG, 1.5)),
}


def hand_set_table() -> np.ndarray:
    """Words of a known geometry; every other word random in dimensions of its own; the padding
    rows and the '<pad>' special row are copies of 'king', so they would win if searched."""
    rng = np.random.default_rng(0)
    table = np.zeros((VOCAB, D), dtype=np.float32)
    table[:, 8:] = rng.normal(size=(VOCAB, D - 8))
    for word, vector in HAND_SET.items():
        table[ID[word]] = vector
    table[TOKENIZER_LEN:] = KING
    table[ID["<pad>"]] = KING
    return table


def _overwrite(folder: Path, name: str, table: np.ndarray) -> None:
    from safetensors.numpy import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    assert tensors[name].shape == table.shape
    tensors[name] = table
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def hand_set(tiny, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hand-set")
    shutil.copytree(tiny("llama-tied"), folder, dirs_exist_ok=True)
    _overwrite(folder, "model.embed_tokens.weight", hand_set_table())
    return folder


@pytest.fixture(scope="module")
def hand_set_untied(tiny, tmp_path_factory) -> Path:
    """Untied: the embedding hand-set as above, the head with 'king' next to 'dog'."""
    folder = tmp_path_factory.mktemp("hand-set-untied")
    shutil.copytree(tiny("llama-untied"), folder, dirs_exist_ok=True)
    head = np.random.default_rng(1).normal(size=(VOCAB, D)).astype(np.float32)
    head[ID["king"]] = head[ID["dog"]] + 0.1 * head[ID["cat"]]
    head[TOKENIZER_LEN:] = head[ID["king"]]
    from safetensors.numpy import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors["model.embed_tokens.weight"] = hand_set_table()
    tensors["lm_head.weight"] = head
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def _reference(table: np.ndarray, exclude: list[int], query: np.ndarray, k: int) -> list[str]:
    allowed = np.zeros(VOCAB, dtype=bool)
    allowed[:TOKENIZER_LEN] = True
    allowed[exclude] = False
    return [(SPECIALS + WORDS)[i] for i in plain_neighbors(table, allowed, query, k)]


def _tokens(query: dict) -> list[str]:
    return [n["token"] for n in query["neighbors"]]


def test_known_neighbours(cli, hand_set):
    data = cli.json("neighbors", hand_set, "king", "--id", ID["girl"])
    specials = [ID[s] for s in SPECIALS]
    assert data["searched_rows"] == TOKENIZER_LEN - len(SPECIALS)
    assert data["padding_rows"] == VOCAB - TOKENIZER_LEN
    assert data["special_excluded"] == len(SPECIALS)
    king, girl = data["queries"]
    # By construction: prince 0.830, queen 0.800, princess 0.664, man 0.316, boy 0.217.
    assert _tokens(king) == ["prince", "queen", "princess", "man", "boy"]
    cos = [n["cosine"] for n in king["neighbors"]]
    assert cos == pytest.approx(
        [5 / np.sqrt(5 * 7.25), 0.8, 4 / np.sqrt(5 * 7.25), 0.1**0.5, 1 / np.sqrt(5 * 4.25)],
        abs=1e-6,
    )
    table = hand_set_table()
    assert _tokens(king) == _reference(table, [*specials, ID["king"]], KING, 5)
    assert girl["kind"] == "id" and girl["token"] == "girl" and girl["query"] == str(ID["girl"])
    assert _tokens(girl) == _reference(table, [*specials, ID["girl"]], table[ID["girl"]], 5)
    assert _tokens(girl)[:2] == ["boy", "woman"] or _tokens(girl)[:2] == ["woman", "boy"]


def test_padding_never_and_specials_only_when_asked(cli, hand_set):
    # Rows 58..71 and '<pad>' are exact copies of 'king': cosine 1, yet not neighbours.
    plain = cli.json("neighbors", hand_set, "king", "-k", 20)["queries"][0]["neighbors"]
    assert all(n["id"] < TOKENIZER_LEN and n["id"] != ID["<pad>"] for n in plain)
    assert all(n["cosine"] < 0.9 for n in plain)
    data = cli.json("neighbors", hand_set, "king", "--include-special", "-k", 2)
    assert data["searched_rows"] == TOKENIZER_LEN and data["special_excluded"] == 0
    first = data["queries"][0]["neighbors"][0]
    assert first == {"id": ID["<pad>"], "token": "<pad>", "cosine": pytest.approx(1.0)}
    # The largest -k is every searched row; the query's own row is still left out.
    everything = cli.json("neighbors", hand_set, "king", "-k", TOKENIZER_LEN - 4)
    ids = [n["id"] for n in everything["queries"][0]["neighbors"]]
    assert len(ids) == TOKENIZER_LEN - 5 and ID["king"] not in ids


def test_analogy_excludes_its_words(cli, hand_set):
    data = cli.json("neighbors", hand_set, "king - man + woman", " - man + woman", "-k", 3)
    analogy, shift = data["queries"]
    assert _tokens(analogy)[0] == "queen"
    assert not {"king", "man", "woman"} & set(_tokens(analogy))
    table = hand_set_table()
    unit = table / np.linalg.norm(table, axis=1, keepdims=True)
    combined = unit[ID["king"]] - unit[ID["man"]] + unit[ID["woman"]]
    specials = [ID[s] for s in SPECIALS]
    exclude = [*specials, ID["king"], ID["man"], ID["woman"]]
    assert _tokens(analogy) == _reference(table, exclude, combined, 3)
    assert analogy["neighbors"][0]["cosine"] == pytest.approx(
        float(unit[ID["queen"]] @ combined / np.linalg.norm(combined)), abs=1e-6
    )
    assert [t["sign"] for t in shift["terms"]] == [-1, 1]
    # Quoted words keep their text; the table shows the expression and the rows combined.
    out = cli("neighbors", hand_set, "'king' - 'man' + 'woman'", "-k", 1)
    assert out.exit_code == 0 and "'queen'" in out.stdout
    assert "'king' - 'man' + 'woman'" in out.stdout


def test_multi_token_word_is_flagged(cli, hand_set):
    data = cli.json("neighbors", hand_set, "king queen", "-k", 1)
    q = data["queries"][0]
    assert q["split"] is True and q["token_id"] == ID["king"]
    assert q["tokens"] == [
        {"id": ID["king"], "token": "king"},
        {"id": ID["queen"], "token": "queen"},
    ]
    shown = cli("neighbors", hand_set, "king queen")
    said = shown.stdout + shown.stderr
    assert said.count("'king queen' splits into 2 tokens") == 1, said  # said once, not twice


def test_output_matrix(cli, hand_set, hand_set_untied):
    untied = cli.json("neighbors", hand_set_untied, "king", "--matrix", "output", "-k", 2)
    assert untied["matrix"] == "output" and untied["tensor"] == "lm_head.weight"
    assert _tokens(untied["queries"][0])[0] == "dog"
    assert (
        cli.json("neighbors", hand_set_untied, "king")["queries"][0]["neighbors"][0]["token"]
        == "prince"
    )
    # Tied: the output matrix is the embedding, and the user is told so.
    result = cli("neighbors", hand_set, "king", "--matrix", "output", "--json")
    assert result.exit_code == 0
    tied = json.loads(result.stdout)
    assert tied["matrix"] == "output" and tied["tensor"] == "model.embed_tokens.weight"
    assert "the output matrix is the input matrix" in result.stderr
    assert _tokens(tied["queries"][0]) == _tokens(
        cli.json("neighbors", hand_set, "king")["queries"][0]
    )


def test_one_pass_over_the_matrix_for_all_queries(cli, hand_set, monkeypatch):
    """Many queries share one read of the matrix; blocks of any size give the same answer."""
    from embedlens.model import matrix

    whole = cli.json("neighbors", hand_set, "king", "queen", "man - boy + girl", "--id", 30)
    calls: list[tuple[int, int]] = []
    block = matrix.Rows.block

    def counted(self, start, stop):
        calls.append((start, stop))
        return block(self, start, stop)

    monkeypatch.setattr(matrix.Rows, "block", counted)
    monkeypatch.setattr(matrix, "_BLOCK_BYTES", 5 * 4 * D)  # five rows a block
    blocked = cli.json("neighbors", hand_set, "king", "queen", "man - boy + girl", "--id", 30)
    assert calls == [(s, min(s + 5, TOKENIZER_LEN)) for s in range(0, TOKENIZER_LEN, 5)]
    for a, b in zip(whole["queries"], blocked["queries"], strict=True):
        assert [n["id"] for n in a["neighbors"]] == [n["id"] for n in b["neighbors"]]
        assert [n["cosine"] for n in a["neighbors"]] == pytest.approx(
            [n["cosine"] for n in b["neighbors"]]
        )


def test_bfloat16_and_sharded_hub_checkpoints(cli, tiny, tmp_path, hf_home):
    import torch
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bf16"
    shutil.copytree(tiny("llama-tied"), folder)
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(folder / "model.safetensors").items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    table = tensors["model.embed_tokens.weight"].float().numpy()
    data = cli.json("neighbors", folder, "king", "-k", 5)
    specials = [ID[s] for s in SPECIALS]
    assert _tokens(data["queries"][0]) == _reference(
        table, [*specials, ID["king"]], table[ID["king"]], 5
    )
    # A sharded checkpoint in the hub cache gives the same lists as the single file it was cut from.
    hub_cache(tiny("llama-tied", max_shard_size="20KB"), hf_home, "tiny-org/sharded-neighbors")
    sharded = cli.json("neighbors", "tiny-org/sharded-neighbors", "king", "queen")
    single = cli.json("neighbors", tiny("llama-tied"), "king", "queen")
    assert [q["neighbors"] for q in sharded["queries"]] == [
        q["neighbors"] for q in single["queries"]
    ]


@pytest.mark.slow
def test_no_torch_or_transformers(tiny):
    code = (
        "import sys, json\n"
        "from typer.testing import CliRunner\n"
        "from embedlens.cli import app\n"
        f"r = CliRunner().invoke(app, ['neighbors', {str(tiny('llama-tied'))!r}, 'king', '--json'])\n"
        "assert r.exit_code == 0, r.output\n"
        "json.loads(r.stdout)\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["king", "-k", "0"], "-k must be at least 1"),
        (["king", "-k", "55"], "more than the 54 rows searched"),
        (["--id", "72"], "row 72 is out of range: the matrix has 72 rows"),
        (["--id", "60"], "row 60 is a padding row"),
        (["--id", "-1"], "row -1 is negative"),
        ([""], "empty query"),
        ([], "no query given"),
        (["xyzzy"], "'xyzzy' is not in the vocabulary"),
        ([" "], "' ' encodes to no tokens"),
        (["king - "], "cannot parse the expression"),
        (["king + - man"], "cannot parse the expression"),
        (["king", "--matrix", "middle"], "'middle' is not one of 'input', 'output'"),
        (["king", "--pool", "middle"], "'middle' is not one of 'first', 'mean', 'last'"),
    ],
)
def test_bad_input(cli, hand_set, args, message):
    err = cli.fails("neighbors", hand_set, *args, code=2)
    assert message in err


def test_bad_model(cli, tmp_path):
    assert "no such file or directory" in cli.fails("neighbors", tmp_path / "nope", "king", code=1)


def test_rows_without_a_cosine_never_rank(cli, tiny, tmp_path):
    """A zero row and a NaN row have no cosine: even with k past the vocabulary they are not
    listed (a NaN once reached the JSON writer), and a NaN query row is named as such."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "holes"
    shutil.copytree(tiny("llama-tied"), folder)
    tensors = load_file(folder / "model.safetensors")
    table = tensors["model.embed_tokens.weight"]
    queen, man = len(SPECIALS) + WORDS.index("queen"), len(SPECIALS) + WORDS.index("man")
    table[queen] = float("nan")
    table[man] = 0.0
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    searched = cli.json("neighbors", folder, "king")["searched_rows"]
    data = cli.json("neighbors", folder, "king", "-k", searched)
    ids = [n["id"] for n in data["queries"][0]["neighbors"]]
    assert queen not in ids and man not in ids
    assert len(ids) == searched - 2  # every row searched but king and man (queen's is not searched)
    assert "holds NaN values" in cli.fails("neighbors", folder, "queen", code=1)
