"""`embedlens vocab`: rows that never moved from their start (the norm and mean signals), in both
matrices of an untied model, and rows added at the end of the table checked as a group."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.models import FAMILIES, TOKENIZER_LEN, VOCAB, WORDS, write_tokenizer

NEW = [f"<new_{k}>" for k in range(8)]
# Trained rows are far from their initialisation (std 0.02): larger, and sharing a direction
# (SmolLM2's rows have a median norm of 3.15, their mean a norm of 2.18).
TRAINED_STD, OFFSET_NORM = 0.2, 2.0


def _trained_untied(folder: Path, n_tokens: int = TOKENIZER_LEN) -> Path:
    """A tiny untied Llama with one row per token, its embedding and head rows made to look
    trained: noise of std TRAINED_STD around a shared offset of norm OFFSET_NORM."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(FAMILIES["llama-untied"])
    model_type = raw.pop("model_type")
    raw["vocab_size"] = n_tokens
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **raw))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for w in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
            offset = torch.randn(w.shape[1], generator=gen)
            offset *= OFFSET_NORM / offset.norm()
            w.copy_(torch.randn(w.shape, generator=gen) * TRAINED_STD + offset)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


def _resized(folder: Path, *, mean_resizing: bool, copy_from: list[str] | None = None) -> Path:
    """The model with NEW added to its tokenizer and `resize_token_embeddings` giving them rows
    (random, or the mean of the others), not trained; with `copy_from`, each new row (in both
    matrices) is then set to that word's row, as one starts new tokens from similar ones."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert tok.add_tokens(NEW) == len(NEW)
    torch.manual_seed(2)
    model.resize_token_embeddings(len(tok), mean_resizing=mean_resizing)
    if copy_from is not None:
        with torch.no_grad():
            for w in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
                for k, word in enumerate(copy_from):
                    w[TOKENIZER_LEN + k] = w[tok.convert_tokens_to_ids(word)]
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def trained_untied(tmp_path_factory) -> Path:
    return _trained_untied(tmp_path_factory.mktemp("trained-untied"))


def _copy(src: Path, tmp_path: Path, name: str) -> Path:
    return Path(shutil.copytree(src, tmp_path / name))


@pytest.mark.parametrize("mean_resizing", [False, True], ids=["random", "mean"])
def test_added_rows_never_trained_are_flagged_in_both_matrices(
    cli, trained_untied, tmp_path, mean_resizing
):
    folder = _resized(_copy(trained_untied, tmp_path, "resized"), mean_resizing=mean_resizing)
    data = cli.json("vocab", folder)
    scan = data["undertrained"]
    new = list(range(TOKENIZER_LEN, TOKENIZER_LEN + len(NEW)))
    assert data["layout"]["tied"] is False and scan["matrix"] == "output"
    assert scan["input"]["matrix"] == "input" and scan["input"]["tensor"].endswith(
        "embed_tokens.weight"
    )
    signal = "mean" if mean_resizing else "norm"
    found = {c["id"]: c for c in scan["candidates"]}
    for i in new:
        assert set(found[i]["by_matrix"]) == {"input", "output"}
        for matrix in ("input", "output"):
            assert signal in found[i]["by_matrix"][matrix], found[i]
    assert set(found) == set(new)  # no ordinary row is flagged
    assert scan["one_matrix"] == {"input": 0, "output": 0}
    (group,) = scan["groups"]
    assert (group["kind"], group["first"], group["last"], group["count"]) == (
        "added_tokens",
        new[0],
        new[-1],
        len(new),
    )
    assert group["verdict"] == "untrained"
    assert [m["matrix"] for m in group["matrices"]] == ["output", "input"]
    for m in group["matrices"]:
        assert m["flagged"] == len(new) and m["by_signal"][signal] == len(new)
    assert group["summary"].startswith(
        f"the 8 added tokens' rows (ids {new[0]}-{new[-1]}) look untrained in both matrices: "
    )
    ids = f"ids {new[0]}-{new[-1]}"
    assert data["problems"] == [
        f"the 8 added tokens ({ids}) have rows that look untrained: the model has not learnt them"
    ]
    out = cli("vocab", folder)
    assert out.exit_code == 0, out.stderr
    assert f"The 8 added tokens' rows ({ids}) look untrained in both matrices" in out.stdout
    assert f"{signal} (both)" in out.stdout


def test_added_rows_started_from_similar_tokens_are_not_flagged(cli, trained_untied, tmp_path):
    similar = ["king", "queen", "man", "woman", "cat", "dog", "sun", "moon"]
    folder = _copy(trained_untied, tmp_path, "started")
    _resized(folder, mean_resizing=True, copy_from=similar)
    data = cli.json("vocab", folder)
    scan = data["undertrained"]
    assert scan["candidates"] == [] and scan["by_signal"] == {"indicator": 0, "norm": 0, "mean": 0}
    (group,) = scan["groups"]
    assert group["verdict"] == "ordinary" and [m["flagged"] for m in group["matrices"]] == [0, 0]
    assert "look like the ordinary rows in both matrices" in group["summary"]
    assert data["problems"] == []
    # Each new row equals its word's row in both matrices: listed as equal, not as untrained.
    pairs = sorted([4 + WORDS.index(w), TOKENIZER_LEN + k] for k, w in enumerate(similar))
    assert sorted(scan["identical_rows"]) == sorted(scan["input"]["identical_rows"]) == pairs


def test_one_matrix_untrained_is_said(cli, trained_untied, tmp_path):
    """Rows reset in the embedding only: flagged there, not in the head, and said so."""
    from safetensors.numpy import load_file, save_file

    folder = _copy(trained_untied, tmp_path, "one")
    tensors = load_file(folder / "model.safetensors")
    ids = [4 + WORDS.index(w) for w in ("Paris", "Rome")]
    table = tensors["model.embed_tokens.weight"]
    table[ids] = np.random.default_rng(0).standard_normal((2, table.shape[1])) * 0.02
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    scan = cli.json("vocab", folder)["undertrained"]
    found = {c["id"]: c for c in scan["candidates"]}
    assert set(found) == set(ids)
    for i in ids:
        assert found[i]["by_matrix"] == {"output": [], "input": ["norm"]}
        assert found[i]["input"]["norm"] < 0.2 and found[i]["norm"] > 1.0
    assert scan["one_matrix"] == {"input": 2, "output": 0}
    assert scan["input"]["flagged"]["norm"] == 2 and scan["flagged"]["norm"] == 0
    out = cli("vocab", folder).stdout
    assert "rows that disagree: 0 tokens flagged in the head only, 2 in the embedding only" in out
    assert "norm (emb.)" in out


# --- tied models: the norm signal beside the indicator, and --verify over both ------------------


@pytest.fixture
def planted_and_reset(tiny, tmp_path) -> Path:
    """The tiny tied model with two words' rows at the padding rows' mean (the indicator's
    kind) and two reset to a tenth of their initialisation scale (the norm's kind)."""
    from safetensors.numpy import load_file, save_file

    folder = Path(shutil.copytree(tiny("llama-tied"), tmp_path / "planted"))
    tensors = load_file(folder / "model.safetensors")
    table = tensors["model.embed_tokens.weight"]
    for word in ("prince", "princess"):
        table[4 + WORDS.index(word)] = table[TOKENIZER_LEN:].mean(axis=0)
    rng = np.random.default_rng(0)
    for word in ("boy", "girl"):
        table[4 + WORDS.index(word)] = rng.standard_normal(table.shape[1]) * 0.002
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_norm_signal_is_the_stated_rule(cli, planted_and_reset):
    from safetensors.numpy import load_file

    table = load_file(planted_and_reset / "model.safetensors")["model.embed_tokens.weight"]
    scan = cli.json("vocab", planted_and_reset)["undertrained"]
    norms = np.linalg.norm(table.astype(np.float64), axis=1)
    ordinary = list(range(4, TOKENIZER_LEN))  # the words: WordLevel has no unreachable token
    assert scan["ordinary_rows"] == len(ordinary)
    logs = np.log(norms[ordinary])
    centre = np.median(logs)
    spread = 1.4826 * np.median(np.abs(logs - centre))
    assert scan["ordinary_norm_median"] == pytest.approx(np.exp(centre), rel=1e-5)
    assert scan["norm_low"] == pytest.approx(np.exp(centre - 6 * spread), rel=1e-5)
    assert scan["norm_high"] == pytest.approx(np.exp(centre + 6 * spread), rel=1e-5)
    with np.errstate(divide="ignore"):  # '<pad>' has an all-zero row: log norm -inf
        score = (np.log(norms[:TOKENIZER_LEN]) - centre) / spread
    flagged = sorted(i for i in range(TOKENIZER_LEN) if abs(score[i]) >= 6)
    reset = [4 + WORDS.index(w) for w in ("boy", "girl")]
    # The planted rows are the mean of ten rows: a third of a row's norm, flagged too.
    assert flagged == sorted([3, *planted_ids(), *reset])
    by_norm = sorted(c["id"] for c in scan["candidates"] if "norm" in c["signals"])
    assert by_norm == flagged
    for c in scan["candidates"]:
        if c["id"] != 3:
            assert c["norm_score"] == pytest.approx(score[c["id"]], rel=1e-4, abs=1e-4)
    assert min(c["norm_score"] or -np.inf for c in scan["candidates"]) == -np.inf
    assert set(planted_ids()) <= {
        c["id"] for c in scan["candidates"] if "indicator" in c["signals"]
    }
    # The padding rows are random like the rest of this untrained model: not flagged as a group.
    (group,) = scan["groups"]
    assert (group["kind"], group["first"], group["count"]) == (
        "past_tokenizer",
        TOKENIZER_LEN,
        VOCAB - TOKENIZER_LEN,
    )
    assert group["verdict"] == "ordinary"


def planted_ids() -> list[int]:
    return [4 + WORDS.index(w) for w in ("prince", "princess")]


def test_verify_asks_about_candidates_of_either_signal(cli, planted_and_reset):
    data = cli.json("vocab", planted_and_reset, "--verify", "--max-verify", "2")
    scan = data["undertrained"]
    asked = [c for c in scan["candidates"] if c["repeat_prob"] is not None]
    assert scan["verified"] == len(asked) == 2
    # The signals take turns: the indicator's strongest, then the norm's ('<pad>', all zero).
    assert "indicator" in asked[0]["signals"] and asked[1]["signals"] == ["norm"]
    for c in asked:
        assert 0.0 < c["repeat_prob"] < 1.0
        assert c["verdict"] == ("confirmed" if c["repeat_prob"] < 0.01 else "rejected")


def test_a_row_at_the_mean_of_the_others_is_flagged(tmp_path):
    """The mean signal on a table written directly: one row set to the mean of the rows."""
    from embedlens.analysis.vocab.kinds import TokenKinds
    from embedlens.analysis.vocab.signals import Matrix, ReferenceRows, Tokens
    from embedlens.analysis.vocab.undertrained import scan
    from embedlens.io.source import resolve
    from embedlens.model.matrix import locate, open_rows
    from embedlens.model.tokenizer import load_vocab

    rng = np.random.default_rng(3)
    n, d = 300, 64
    table = (rng.standard_normal((n, d)) * 0.3 + rng.standard_normal(d)).astype(np.float32)
    table[17] = table.mean(axis=0)
    path = _gguf(tmp_path / "table.gguf", table)
    source = resolve(str(path))
    located = locate(source, "output")
    vocab = load_vocab(source, located.checkpoint.gguf)
    tokens = Tokens(ReferenceRows(TokenKinds.of({})), [], frozenset(), [])
    rows = open_rows(source, located)
    got = scan([Matrix(rows, located.name, "input")], vocab, tokens, all_tokens=False)
    (c,) = got.candidates
    assert c.id == 17 and c.signals == ["mean"] and c.mean_distance < 0.01
    centre = table.mean(axis=0, dtype=np.float64)
    distance = np.linalg.norm(table - centre, axis=1)
    assert got.mean_distance_median == pytest.approx(np.median(distance), rel=1e-5)


def _gguf(path: Path, table: np.ndarray) -> Path:
    """A GGUF holding an F32 token_embd and a byte-level vocabulary of one token a row."""
    import gguf

    from embedlens.model.tokens import byte_alphabet

    letters = list(byte_alphabet().values())
    tokens = letters + [f"t{i}" for i in range(table.shape[0] - len(letters))]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(table.shape[1])
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens[: table.shape[0]])
    writer.add_token_merges(["t 0"])
    writer.add_tensor("token_embd.weight", table)
    writer.add_tensor("output_norm.weight", np.ones(table.shape[1], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_group_lines_say_each_matrix_verdict():
    from embedlens.analysis.vocab.groups import group_line
    from embedlens.reports.vocab import GroupMatrix

    def part(matrix: str, flagged: int, verdict: str, norm: float = 0.02) -> GroupMatrix:
        return GroupMatrix(
            matrix, norm, 3.15, flagged, {"norm": flagged} if flagged else {}, verdict
        )

    one = group_line("added_tokens", [70], [part("input", 1, "untrained")])
    assert (
        one
        == "the added token's row (id 70) looks untrained: norm 0.02 against 3.15 (1 of 1 flagged: norm 1)"
    )
    pad = group_line("past_tokenizer", [5, 6, 7], [part("input", 0, "ordinary", 3.1)])
    assert pad == (
        "the 3 rows past the tokenizer (ids 5-7) look like the ordinary rows: norm 3.1 against "
        "3.15 (none flagged)"
    )
    split = group_line(
        "added_tokens",
        list(range(8)),
        [part("output", 0, "ordinary", 3.0), part("input", 3, "partly untrained")],
    )
    assert split == (
        "the 8 added tokens' rows (ids 0-7): in the head they look like the ordinary rows (norm 3 "
        "against 3.15, none flagged); in the embedding 3 of 8 look untrained (norm 0.02 against "
        "3.15, 3 of 8 flagged: norm 3)"
    )
