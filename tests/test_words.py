"""A word wholly inside one pair of quotes is the word between them, wherever a word is typed."""

from __future__ import annotations

import pytest

from embedlens.model.words import literal_note, unquoted


@pytest.mark.parametrize(
    ("typed", "word"),
    [
        ("' king'", " king"),
        ('" king"', " king"),
        ("'king'", "king"),
        ("' '", " "),
        ("'it''s'", "it''s"),  # the outer pair holds the whole text
        ("king", "king"),
        (" king", " king"),
        ("'king", "'king"),  # no closing quote
        ("'king\"", "'king\""),  # two different quotes are no pair
        ("''", "''"),  # quotes alone are the tokens they spell
        ("'''", "'''"),
        ('"""', '"""'),
        ("'", "'"),
    ],
)
def test_unquoted(typed: str, word: str):
    assert unquoted(typed) == word


def test_a_quoted_token_of_its_own_gets_a_note():
    tokens = {"','": 8178, ",": 28, "king": 5}

    def encode(text: str) -> list[int]:
        return [tokens[text]] if text in tokens else [1, 2]

    def text(i: int) -> str:
        return {v: k for k, v in tokens.items()}[i]

    note = literal_note("','", encode, text, "give --id {id}")
    assert note == (
        "\"','\" is read as the word between its quotes, ','; to use the token \"','\" itself "
        "(id 8178), give --id 8178"
    )
    assert literal_note("'king'", encode, text, "give --id {id}") is None  # no such token
    assert literal_note(",", encode, text, "give --id {id}") is None  # not quoted


def test_neighbors_reads_a_quoted_word_as_the_word(cli, tiny):
    folder = tiny("llama-tied")
    plain = cli.json("neighbors", folder, "king", "queen", "-k", 3)
    quoted = cli.json("neighbors", folder, "'king'", '"queen"', "-k", 3)
    assert quoted["queries"] == plain["queries"]
    inside = cli.json("neighbors", folder, "'king' - 'man' + \"woman\"", "-k", 3)
    words = [t["text"] for t in inside["queries"][0]["terms"]]
    assert words == ["king", "man", "woman"]


def test_addr_reads_a_quoted_word_as_the_word(cli, tiny):
    folder = tiny("llama-tied")
    rows = cli.json("addr", folder, "'king'", "king", "--no-check")["rows"]
    assert rows[0]["row"] == rows[1]["row"] and rows[0]["token"] == "king"
    assert rows[0]["query"] == "king"


def test_a_quoted_number_is_a_token_for_addr(cli, tiny):
    """A ROW in quotes is text, never an id: "'4'" looks up the token '4' (here: none)."""
    folder = tiny("llama-tied")
    assert "'4' is not in the vocabulary" in cli.fails("addr", folder, "'4'", code=2)
    assert cli.json("addr", folder, "4", "--no-check")["rows"][0]["row"] == 4


def test_smollm2_quoted_words_keep_their_leading_space(cli, smollm2):
    """README: quote a word to keep its leading space: "' king'" is ' king' (id 4197), not the
    apostrophe (id 23) it began with; "','" is ',' with a note naming the token "','" itself."""
    data = cli.json("neighbors", smollm2, "' king'", "-k", 1)
    assert data["queries"][0]["token_id"] == 4197 and data["queries"][0]["query"] == " king"
    rows = cli.json("addr", smollm2, "' king'", "--no-check")["rows"]
    assert rows[0]["row"] == 4197
    result = cli("neighbors", smollm2, "','", "-k", 1)
    assert result.exit_code == 0, result.stderr
    assert "the token \"','\" itself (id 8178), give --id 8178" in result.stderr
    assert "Nearest to ',' (id 28)" in result.stdout
