"""`embedlens vocab`: the vocabulary against the matrices, under-trained rows, drift between
tokenizers, and whether the weights fit a tokenizer; on tiny built models and on SmolLM2."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.models import SPECIALS, TOKENIZER_LEN, VOCAB, WORDS

INSERT_AT = 4 + 20  # four special tokens inserted after the 20th word
NEW = ["<tool>", "</tool>", "<think>", "</think>"]


def _tokenizer(folder: Path) -> dict:
    return json.loads((folder / "tokenizer.json").read_text())


def _write(tmp: Path, name: str, data: dict) -> Path:
    path = tmp / name
    path.write_text(json.dumps(data))
    return path


def _with_tokens(base: dict, order: list[str], specials: list[str]) -> dict:
    """The tiny WordLevel tokenizer with its vocabulary in `order`; `specials` as added tokens."""
    data = copy.deepcopy(base)
    data["model"]["vocab"] = {t: i for i, t in enumerate(order)}
    template = data["added_tokens"][0]
    data["added_tokens"] = [{**template, "id": order.index(t), "content": t} for t in specials]
    return data


@pytest.fixture
def inserted(tiny, tmp_path) -> Path:
    """The tiny tokenizer with 4 special tokens inserted in the middle: later ids move by 4."""
    order = SPECIALS + WORDS[:20] + NEW + WORDS[20:]
    data = _with_tokens(_tokenizer(tiny("llama-tied")), order, SPECIALS + NEW)
    return _write(tmp_path, "inserted.json", data)


@pytest.fixture
def appended(tiny, tmp_path) -> Path:
    """The tiny tokenizer with 4 special tokens appended at the end: no id moves."""
    order = SPECIALS + WORDS + NEW
    data = _with_tokens(_tokenizer(tiny("llama-tied")), order, SPECIALS + NEW)
    return _write(tmp_path, "appended.json", data)


# --- the vocabulary against the matrices ---------------------------------------------------------


def test_padding_rows_past_the_tokenizer(cli, tiny):
    data = cli.json("vocab", tiny("llama-tied"))
    assert data["command"] == "vocab" and data["schema_version"] == 1
    lay = data["layout"]
    assert lay["tokenizer_size"] == TOKENIZER_LEN
    assert lay["embedding_rows"] == lay["head_rows"] == VOCAB
    assert lay["padding_rows"] == VOCAB - TOKENIZER_LEN
    assert lay["missing_rows"] == 0
    assert lay["added_placement"] == "start" and lay["inserted"] == []
    assert [t["token"] for t in lay["special_tokens"]] == SPECIALS
    assert data["unreachable"]["count"] == 0
    assert data["undertrained"]["reference_by_kind"] == {"padding": VOCAB - TOKENIZER_LEN}
    assert data["problems"] == []
    table = cli("vocab", tiny("llama-tied"))
    assert table.exit_code == 0, table.stderr
    assert "padding rows" in table.stdout and "No problem found" in table.stdout


def test_inserted_special_tokens_are_flagged(cli, tiny, inserted):
    data = cli.json("vocab", tiny("llama-tied"), "--tokenizer", inserted)
    lay = data["layout"]
    assert lay["added_placement"] == "inside"
    assert [(t["id"], t["token"]) for t in lay["inserted"]] == [
        (INSERT_AT + k, t) for k, t in enumerate(NEW)
    ]
    assert data["tokenizer"] == str(inserted)
    assert any("inside the ordinary range" in p for p in data["problems"])


def test_against_finds_the_block_shift(cli, tiny, inserted):
    data = cli.json("vocab", tiny("llama-tied"), "--against", inserted)
    diff = data["against"]
    assert not diff["identical"] and not diff["compatible"]
    assert diff["shifts"][0] == {
        "start": INSERT_AT,
        "stop": TOKENIZER_LEN - 1,
        "by": 4,
        "count": TOKENIZER_LEN - INSERT_AT,
    }
    assert diff["same_ids"] == INSERT_AT and diff["added"] == 4 and diff["removed"] == 0
    assert [t["token"] for t in diff["added_examples"]] == NEW
    expected = (
        f"ids {INSERT_AT:,}-{TOKENIZER_LEN - 1:,} moved by +4 in '{inserted}' after 4 tokens "
        f"were inserted at {INSERT_AT:,}"
    )
    assert diff["summary"][0] == expected
    assert expected in data["problems"]


def test_tokens_appended_at_the_end_are_harmless(cli, tiny, appended):
    data = cli.json("vocab", tiny("llama-tied"), "--against", appended)
    diff = data["against"]
    assert diff["compatible"] and not diff["identical"]
    assert diff["shifts"] == [] and diff["removed"] == 0 and diff["added"] == 4
    assert data["problems"] == []
    own = cli.json("vocab", tiny("llama-tied"), "--tokenizer", appended)
    assert own["layout"]["added_placement"] == "start and end"
    assert own["layout"]["padding_rows"] == VOCAB - TOKENIZER_LEN - 4
    assert own["problems"] == []


def test_against_itself_is_identical(cli, tiny):
    folder = tiny("llama-tied")
    data = cli.json("vocab", folder, "--against", folder / "tokenizer.json")
    assert data["against"]["identical"] and data["against"]["compatible"]
    assert data["against"]["other_fingerprint"] == data["fingerprint"]["sha256"]


def test_tokens_without_a_row_are_a_problem(cli, tiny, tmp_path):
    extra = [f"extra{i}" for i in range(VOCAB + 8 - TOKENIZER_LEN)]
    order = SPECIALS + WORDS + extra
    path = _write(
        tmp_path, "big.json", _with_tokens(_tokenizer(tiny("llama-tied")), order, SPECIALS)
    )
    data = cli.json("vocab", tiny("llama-tied"), "--tokenizer", path)
    assert data["layout"]["missing_rows"] == 8
    assert any("8 tokens have no row" in p for p in data["problems"])


def test_fingerprint_follows_ids_and_bytes(cli, tiny, tmp_path):
    base = _tokenizer(tiny("llama-tied"))
    swapped = [*SPECIALS, WORDS[1], WORDS[0], *WORDS[2:]]
    a = cli.json("vocab", tiny("llama-tied"))["fingerprint"]["sha256"]
    b = cli.json("vocab", tiny("llama-untied"))["fingerprint"]["sha256"]
    path = _write(tmp_path, "swapped.json", _with_tokens(base, swapped, SPECIALS))
    c = cli.json("vocab", tiny("llama-tied"), "--tokenizer", path)["fingerprint"]["sha256"]
    assert a == b  # the same vocabulary in another model
    assert c != a and len(a) == 64


def test_metadata_hash_is_compared(cli, tiny, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "hashed"
    shutil.copytree(tiny("llama-tied"), folder)
    sha = cli.json("vocab", folder)["fingerprint"]["sha256"]
    tensors = load_file(folder / "model.safetensors")
    for value, matches in ((sha, True), ("0" * 64, False)):
        save_file(
            tensors,
            folder / "model.safetensors",
            metadata={"format": "pt", "tokenizer_sha256": value},
        )
        data = cli.json("vocab", folder)
        assert data["fingerprint"]["metadata_key"] == "tokenizer_sha256"
        assert data["fingerprint"]["matches"] is matches
        assert bool(data["problems"]) is (not matches)


# --- the under-trained indicator ---------------------------------------------------------------


def _reference_indicator(matrix: np.ndarray, reference: list[int]) -> np.ndarray:
    """Fishing-for-Magikarp's indicator with a full PCA (SVD of the centred matrix)."""
    centred = matrix - matrix.mean(axis=0)
    u = np.linalg.svd(centred, full_matrices=False)[2][0]
    removed = matrix - np.outer(matrix @ u, u)
    ref = removed[reference].mean(axis=0)
    with np.errstate(invalid="ignore"):  # the all-zero '<pad>' row has no direction
        return removed @ ref / (np.linalg.norm(removed, axis=1) * np.linalg.norm(ref))


@pytest.fixture
def planted(tiny, tmp_path) -> Path:
    """The tiny model with two words' rows set to the padding rows' mean (rows never trained
    drift together, the way unused rows do)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "planted"
    shutil.copytree(tiny("llama-tied"), folder)
    tensors = load_file(folder / "model.safetensors")
    table = tensors["model.embed_tokens.weight"]
    for word in ("prince", "princess"):
        table[4 + WORDS.index(word)] = table[TOKENIZER_LEN:].mean(axis=0)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_indicator_is_the_papers(cli, planted):
    from safetensors.numpy import load_file

    matrix = load_file(planted / "model.safetensors")["model.embed_tokens.weight"].astype(
        np.float64
    )
    data = cli.json("vocab", planted)
    scan = data["undertrained"]
    reference = list(range(TOKENIZER_LEN, VOCAB))
    expected = _reference_indicator(matrix, reference)
    got = np.array(scan["indicators"], dtype=float)  # null (an all-zero row, '<pad>') as NaN
    assert np.isnan(got[3]) and np.isnan(expected[3])
    assert np.allclose(got, expected, atol=1e-4, equal_nan=True)
    assert np.allclose(scan["norms"], np.linalg.norm(matrix, axis=1), rtol=1e-5, atol=1e-6)
    threshold = np.percentile(expected[reference], 99)  # the padding rows are all non-zero
    assert scan["threshold"] == pytest.approx(threshold, abs=1e-4)
    flagged = [i for i in range(TOKENIZER_LEN) if expected[i] >= scan["threshold"] - 1e-6]
    assert sorted(c["id"] for c in scan["candidates"] if "indicator" in c["signals"]) == flagged
    planted_ids = [4 + WORDS.index("prince"), 4 + WORDS.index("princess")]
    assert set(planted_ids) <= set(flagged)
    assert [planted_ids] == scan["identical_rows"]
    assert scan["by_signal"]["indicator"] == len(flagged)
    # '<pad>' (id 3) has an all-zero row: no indicator, but the norm signal flags it.
    others = {c["id"]: c["signals"] for c in scan["candidates"] if c["id"] not in flagged}
    assert others == {3: ["norm"]}
    assert scan["counts"]["candidate"] == len(scan["candidates"]) == len(flagged) + 1


def test_verify_asks_the_model(cli, planted):
    data = cli.json("vocab", planted, "--verify", "--max-verify", "2")
    scan = data["undertrained"]
    asked = [c for c in scan["candidates"] if c["repeat_prob"] is not None]
    assert scan["verified"] == len(asked) == min(2, len(scan["candidates"]))
    for c in asked:
        assert 0.0 < c["repeat_prob"] < 1.0
        assert c["verdict"] == ("confirmed" if c["repeat_prob"] < 0.01 else "rejected")
    assert all(c["verdict"] == "candidate" for c in scan["candidates"][2:])


def test_verify_reports_progress_and_the_former_names_still_work(cli, planted):
    """`progress=` is called as every long call's (stage, done, total, unit); the former
    `on_progress=(done, total)` and `all=` work for one more release, with a warning each, and
    give the same report."""
    import embedlens

    calls: list[tuple] = []

    def progress(stage: str, done: int, total: int, unit: str, detail: str = "") -> None:
        calls.append((stage, done, total, unit))

    report = embedlens.vocab(planted, verify=True, max_verify=2, progress=progress)
    assert calls and all(c[0] == "verifying" and c[3] == "batches" for c in calls)
    assert [c[1] for c in calls] == list(range(1, calls[-1][2] + 1))
    old: list[tuple] = []
    with pytest.warns(DeprecationWarning, match="on_progress"):
        former = embedlens.vocab(
            planted, verify=True, max_verify=2, on_progress=lambda *a: old.append(a)
        )
    assert old == [c[1:3] for c in calls]
    assert (
        former.to_dict()
        == report.to_dict()
        == cli.json("vocab", planted, "--verify", "--max-verify", "2")
    )
    with pytest.warns(DeprecationWarning, match="all="):
        every = embedlens.vocab(planted, all=True)
    assert every.shows_all and not embedlens.vocab(planted).shows_all
    with pytest.raises(TypeError, match="'everything'"):
        embedlens.vocab(planted, everything=True)


def test_check_fit_on_a_random_model_does_not_pass(cli, tiny):
    data = cli.json("vocab", tiny("llama-tied"), "--check-fit")
    fit = data["fit"]
    assert [x["language"] for x in fit["languages"]] == ["en", "zh"]
    for x in fit["languages"]:
        assert x["tokens"] > 0
        assert x["uniform_loss"] == pytest.approx(np.log(VOCAB))
        contrast = x["shifted_loss"] - x["loss"] >= fit["margin"]
        assert x["fits"] is (contrast and x["rise"] <= x["threshold"])
    assert fit["fits"] is False  # random weights fit no tokenizer
    assert any("do not fit" in p for p in data["problems"])


@pytest.mark.slow
def test_static_parts_never_import_torch(tiny, inserted):
    code = (
        "import sys, json\n"
        "from typer.testing import CliRunner\n"
        "from embedlens.cli import app\n"
        f"r = CliRunner().invoke(app, ['vocab', {str(tiny('llama-tied'))!r}, '--against', "
        f"{str(inserted)!r}, '--json'])\n"
        "assert r.exit_code == 0, r.output\n"
        "json.loads(r.stdout)\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--max-verify", "0"], 2, "--max-verify must be at least 1"),
        (["--against", "/nonexistent/tok.json"], 1, "no such file or directory"),
        (["--dtype", "float8"], 2, "'float8' is not one of 'auto', 'float32'"),
        (["--tokenizer", "/nonexistent"], 1, "no such file or directory"),
    ],
)
def test_bad_input(cli, tiny, args, code, message):
    assert message in cli.fails("vocab", tiny("llama-tied"), *args, code=code)


def test_corrupt_other_tokenizer(cli, tiny, tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    assert "'tokenizer.json' is not valid JSON" in cli.fails(
        "vocab", tiny("llama-tied"), "--against", bad, code=1
    )


# --- SmolLM2 (real) ------------------------------------------------------------------------------

SMOL_SPECIALS = 17  # <|endoftext|> ... <empty_output>, ids 0-16


@pytest.fixture(scope="module")
def smol_folder(smollm2, tmp_path_factory) -> Path:
    """SmolLM2's safetensors form: the GGUF loaded by transformers and saved again."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("smollm2-safetensors")
    kwargs = {"gguf_file": smollm2.name}
    from safetensors.torch import save_file

    from embedlens.compat.transformers.gguf_patches import sharing_gguf_reads

    # The patched load gives transformers' own tensors (test_gguf_patches.py) in a fifth of the time.
    with sharing_gguf_reads():
        model = AutoModelForCausalLM.from_pretrained(smollm2.parent, dtype=torch.float32, **kwargs)
    # save_pretrained refuses a model loaded from GGUF: write its weights and config directly.
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config))
    AutoTokenizer.from_pretrained(smollm2.parent, **kwargs).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def smol_gguf(smollm2) -> dict:
    """`embedlens vocab SMOLLM2.gguf --json`, run once for the tests that read it."""
    from tests.conftest import Runner

    return Runner().json("vocab", smollm2)


@pytest.fixture(scope="module")
def shifted_by_4(smol_folder, tmp_path_factory) -> Path:
    """SmolLM2's tokenizer with 4 tokens inserted after its specials: every later id is +4."""
    data = json.loads((smol_folder / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    order = sorted(vocab, key=vocab.get)
    new = [f"<new_{k}>" for k in range(4)]
    order = order[:SMOL_SPECIALS] + new + order[SMOL_SPECIALS:-4]  # the same size as before
    data["model"]["vocab"] = {t: i for i, t in enumerate(order)}
    data["model"]["merges"] = [
        m
        for m in data["model"]["merges"]
        if all(p in data["model"]["vocab"] for p in (m.split(" ") if isinstance(m, str) else m))
        and ("".join(m.split(" ")) if isinstance(m, str) else "".join(m)) in data["model"]["vocab"]
    ]
    path = tmp_path_factory.mktemp("shifted") / "tokenizer.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.slow
def test_smollm2_fingerprint_is_stable_across_forms(cli, smol_gguf, smol_folder):
    gguf = smol_gguf
    folder = cli.json("vocab", smol_folder)
    assert gguf["fingerprint"]["sha256"] == folder["fingerprint"]["sha256"]
    assert gguf["layout"]["tokenizer_size"] == folder["layout"]["tokenizer_size"] == 49152
    assert gguf["unreachable"] == folder["unreachable"]
    assert [t["id"] for t in gguf["layout"]["special_tokens"]] == list(range(SMOL_SPECIALS))


@pytest.mark.slow
def test_smollm2_unreachable_tokens_do_not_round_trip(smol_gguf, smol_folder):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_folder)
    data = smol_gguf
    unreachable = data["unreachable"]
    assert unreachable["count"] == sum(unreachable["by_kind"].values()) > 0
    assert len(unreachable["tokens"]) == sum(min(100, n) for n in unreachable["by_kind"].values())
    for t in unreachable["tokens"][:: max(1, unreachable["count"] // 40)]:
        again = tok.encode(tok.decode([t["id"]]), add_special_tokens=False)
        assert again != [t["id"]] and again == t["encodes_as"]
        assert t["kind"] in ("single_byte", "partial_utf8")  # byte-level BPE: only fragments


@pytest.mark.slow
def test_smollm2_identical_rows_are_identical(smol_gguf, smollm2):
    import gguf
    from gguf.quants import dequantize

    data = smol_gguf
    scan = data["undertrained"]
    reader = gguf.GGUFReader(smollm2)
    tensor = next(t for t in reader.tensors if t.name == "token_embd.weight")
    table = dequantize(tensor.data, tensor.tensor_type).reshape(49152, -1)
    assert scan["identical_rows"], "SmolLM2 has rows that training never moved apart"
    candidates = {c["id"] for c in scan["candidates"]}
    for group in scan["identical_rows"]:
        assert all(np.array_equal(table[group[0]], table[i]) for i in group[1:])
        assert set(group) <= candidates
    assert len(scan["indicators"]) == 49152


@pytest.mark.slow
def test_smollm2_check_fit_own_tokenizer_and_shifted(cli, smol_folder, shifted_by_4):
    own = cli.json("vocab", smol_folder, "--check-fit")
    assert own["fit"]["fits"] is True, own["fit"]
    assert own["problems"] == []
    drift = cli.json("vocab", smol_folder, "--check-fit", "--tokenizer", shifted_by_4)
    assert drift["fit"]["fits"] is False, drift["fit"]
    for lang in drift["fit"]["languages"]:
        assert lang["loss"] > own["fit"]["languages"][0]["loss"] + 2
    against = cli.json("vocab", smol_folder, "--against", shifted_by_4)
    top = against["against"]["shifts"][0]
    assert (top["start"], top["by"]) == (SMOL_SPECIALS, 4)
    assert "after 4 tokens were inserted at 17" in against["against"]["summary"][0]


def test_check_fit_with_ids_past_the_rows_does_not_fit(cli, tiny, tmp_path):
    extra = [f"extra{i}" for i in range(70)]  # the words land at ids 74 and on: no rows there
    order = SPECIALS + extra + WORDS
    path = _write(
        tmp_path, "far.json", _with_tokens(_tokenizer(tiny("llama-tied")), order, SPECIALS)
    )
    data = cli.json("vocab", tiny("llama-tied"), "--check-fit", "--tokenizer", path)
    en = data["fit"]["languages"][0]
    assert en["fits"] is False and en["loss"] is None and en["shifted_loss"] is None
    assert data["fit"]["fits"] is False
    assert data["layout"]["missing_rows"] == len(order) - VOCAB


def _bpe_gguf(path: Path, extra: list[str], merges: list[str]) -> Path:
    """A byte-level BPE GGUF: the 256 byte symbols, then `extra` pieces, built by `merges`."""
    import gguf

    from embedlens.model.tokens import byte_alphabet

    tokens = list(byte_alphabet().values()) + extra
    rows = np.random.default_rng(0).standard_normal((len(tokens), 32)).astype(np.float32)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_tensor("token_embd.weight", rows)
    writer.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_pieces_no_merge_builds_are_unmerged(cli, tmp_path):
    from embedlens.io.gguf import read_gguf_header
    from embedlens.model.tokenizer import vocab_from_gguf

    path = _bpe_gguf(tmp_path / "bpe.gguf", ["ab", "abc", "xy", "abab"], ["a b", "ab ab"])
    data = cli.json("vocab", path)
    kinds = {t["token"]: (t["id"], t["kind"]) for t in data["unreachable"]["tokens"]}
    assert kinds["abc"] == (257, "unmerged") and kinds["xy"] == (258, "unmerged")
    assert "ab" not in kinds and "abab" not in kinds
    assert data["unreachable"]["by_kind"]["unmerged"] == 2
    assert data["undertrained"]["reference_by_kind"]["unmerged"] == 2
    # The round trip agrees: encoding their text does not give them back.
    vocab = vocab_from_gguf(read_gguf_header(path))
    for text, (i, _) in (("abc", kinds["abc"]), ("xy", kinds["xy"])):
        assert vocab.encode(text) != [i]
        assert [t["encodes_as"] for t in data["unreachable"]["tokens"] if t["id"] == i] == [
            vocab.encode(text)
        ]
    assert vocab.encode("abab") == [259]


def test_gguf_pieces_are_what_the_tokenizer_stores(tmp_path):
    """vocab_from_gguf keeps every id's entry as read (not asking the rebuilt tokenizer): the
    same as the tokenizer's own table, with a repeated entry and one stored as text."""
    from dataclasses import replace

    from embedlens.analysis.vocab.fingerprint import pieces_by_id
    from embedlens.io.gguf import read_gguf_header
    from embedlens.model.tokenizer import vocab_from_gguf

    path = _bpe_gguf(tmp_path / "bpe.gguf", ["ab", "ab", "é x", "abab"], ["a b", "ab ab"])
    vocab = vocab_from_gguf(read_gguf_header(path))
    assert vocab.pieces is not None
    asked = pieces_by_id(replace(vocab, pieces=None))
    assert pieces_by_id(vocab) == asked
    assert len(asked) == vocab.size and asked[256] == "ab" and asked[257] is None
    assert asked[258] == "Ã©Ġx"  # stored as text, respelled in the byte alphabet


def _reset_rows(src: Path, dst: Path, ids: list[int], scale: float) -> Path:
    """A copy of a GGUF whose token_embd rows `ids` are replaced by fresh noise of std `scale`
    (as at initialisation), quantised to the table's own type; the file itself is untouched."""
    import shutil

    import gguf
    from gguf.quants import quantize

    from embedlens.io.gguf import read_gguf_header

    shutil.copyfile(src, dst)
    info = read_gguf_header(dst).tensors["token_embd.weight"]
    qtype = gguf.GGMLQuantizationType(info.type_id)
    width = info.shape[1]
    noise = np.random.default_rng(0).standard_normal((len(ids), width)).astype(np.float32)
    raw = quantize(noise * scale, qtype).reshape(len(ids), info.row_bytes)
    with open(dst, "r+b") as fh:
        for row, i in zip(raw, ids, strict=True):
            fh.seek(info.offset + i * info.row_bytes)
            fh.write(row.tobytes())
    return dst


@pytest.mark.slow
def test_smollm2_rows_reset_to_initialisation_are_flagged_by_norm(
    cli, smol_gguf, smollm2, tmp_path
):
    """20 ordinary tokens' rows reset to initialisation-scale noise (std 0.02, norm about 0.48
    against a median of 3.15): the indicator cannot see them (they share nothing with the
    reference rows), the norm signal flags all 20, and the indicator's candidates stay."""
    from embedlens.io.gguf import read_gguf_header
    from embedlens.model.tokenizer import vocab_from_gguf

    vocab = vocab_from_gguf(read_gguf_header(smollm2))
    words = [i for i in range(1000, 49152, 7) if vocab.text(i).strip().isalpha()]
    ids = words[:: len(words) // 20][:20]
    before = smol_gguf["undertrained"]
    assert not {c["id"] for c in before["candidates"]} & set(ids)
    assert before["by_signal"] == {"indicator": 59, "norm": 0, "mean": 0}
    path = _reset_rows(smollm2, tmp_path / smollm2.name, ids, 0.02)
    after = cli.json("vocab", path)["undertrained"]
    found = {c["id"]: c for c in after["candidates"]}
    for i in ids:
        assert "norm" in found[i]["signals"], found[i]
        assert found[i]["norm"] < 0.6 and found[i]["norm_score"] <= -6
        assert found[i]["by_matrix"] == {"input": found[i]["signals"]}
    # Resetting rows moves the first principal component a little (the indicator of the other
    # rows by up to 0.003): the candidates above the threshold by more than that all stay.
    firm = [c["id"] for c in before["candidates"] if c["indicator"] >= before["threshold"] + 0.003]
    assert len(firm) >= 40
    assert all("indicator" in found[i]["signals"] for i in firm)
    assert abs(after["by_signal"]["indicator"] - 59) <= 3
    assert after["by_signal"]["norm"] == 20
    # The signals take turns: the first 40 candidates hold all 20 reset rows.
    assert set(ids) <= {c["id"] for c in after["candidates"][:40]}
