"""One token, one spelling: `lens` and `neighbors` show a SentencePiece-style token alike.

A Metaspace decoder strips the leading space of the first token it decodes, so a lone '▁king'
decodes to 'king'; every command shows it as ' king' (the text it adds after other tokens).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.models import SPECIALS, WORDS

SPACE = "\u2581"


def metaspace_model(tiny, tmp_path: Path) -> Path:  # type: ignore[no-untyped-def]
    """The tiny llama with a SentencePiece-style tokenizer: every word stored as '▁word'."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "metaspace"
    shutil.copytree(tiny("llama-tied"), folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    vocab = {t: i for i, t in enumerate(SPECIALS + [SPACE + w for w in WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement=SPACE, prepend_scheme="always")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(folder)
    return folder


def test_lens_and_neighbors_spell_a_sentencepiece_token_alike(tiny, cli, tmp_path):
    from transformers import AutoTokenizer

    folder = metaspace_model(tiny, tmp_path)
    king = AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids(SPACE + "king")
    assert AutoTokenizer.from_pretrained(folder).decode([king]) == "king"  # the trap
    lens = cli.json("lens", folder, "the king of", "--target", " king", "-k", "72")
    near = cli.json("neighbors", folder, "--id", str(king))
    shown_by_lens = {t["id"]: t["token"] for t in lens["tokens"]}
    shown_by_lens.update((t["id"], t["token"]) for row in lens["layers"] for t in row["top"])
    assert shown_by_lens[king] == " king" == lens["target"]["token"]
    assert near["queries"][0]["tokens"] == [{"id": king, "token": " king"}]
    for row in near["queries"][0]["neighbors"]:
        assert shown_by_lens[row["id"]] == row["token"], row
