"""What a typed word became in the vocabulary, said in words.

A word may split into several tokens ('北京' is four byte pieces in a byte-level vocabulary), and
a word typed without its leading space ('cat') is often a rarer word piece than the token users
mean (' cat', the word after a space). Both are reported as notes, never silently.

A word typed wholly inside one pair of quotes is the text between them (`"' king'"` is ' king',
with its leading space), wherever a word is typed (`unquoted`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from embedlens.errors import UsageError

Pool = Literal["first", "mean", "last"]
POOLS: tuple[Pool, ...] = ("first", "mean", "last")
"""How a word that splits into several tokens is queried: its first token's row, the mean of the
unit rows of all its tokens, or its last token's row."""

RARER = 2
"""A bare word's token counts as much rarer than the spaced one when its id is at least this many
times larger (BPE ids follow merge order, which follows frequency)."""


QUOTES = ("'", '"')


def unquoted(text: str) -> str:
    """The word a typed text means: the text between one pair of quotes ('…' or "…") that holds
    it whole, with its spaces (`' king'` is ' king'); any other text as it is, quotes alone
    included ('', \'\'\' and \"\"\" are those tokens)."""
    if len(text) > 2 and text[0] in QUOTES and text[-1] == text[0] and set(text) - set(QUOTES):
        return text[1:-1]
    return text


def literal_note(
    typed: str, encode: Callable[[str], list[int]], text: Callable[[int], str], how: str
) -> str | None:
    """A note when a quoted word is, quotes and all, a token of its own (SmolLM2's "','" is id
    8178): the word between the quotes is used; `how` says how to use that token instead, with
    `{id}` for its id."""
    if unquoted(typed) == typed:
        return None
    ids = encode(typed)
    if len(ids) != 1 or text(ids[0]) != typed:
        return None
    outer = '"' if typed[0] == "'" else "'"
    shown = outer + typed + outer
    return (
        f"{shown} is read as the word between its quotes, {_quote(unquoted(typed))}; to use the "
        f"token {shown} itself (id {ids[0]}), {how.format(id=ids[0])}"
    )


def check_pool(pool: str) -> str:
    """The --pool value, or a UsageError."""
    if pool not in POOLS:
        raise UsageError(f"unknown --pool '{pool}'", hint="use one of: " + ", ".join(POOLS))
    return pool


def pooled(ids: Sequence[int], pool: str) -> list[int]:
    """The rows a word's query uses: [first], [last], or every distinct token (mean)."""
    if pool == "last":
        return [ids[-1]]
    if pool == "mean":
        return list(dict.fromkeys(ids))
    return [ids[0]]


def _quote(text: str) -> str:
    return "'" + text + "'"


def split_note(
    word: str, tokens: Sequence[str], ids: Sequence[int], pool: str, verb: str, *, offer: bool
) -> str:
    """'北京' splits into 4 tokens (…); the first (id 30158) is queried (and --pool offered)."""
    pieces = ", ".join(_quote(t) for t in tokens)
    if pool == "mean":
        what = f"the mean of their unit rows is {verb}"
    else:
        at = 0 if pool == "first" else len(ids) - 1
        what = f"the {pool} ({_quote(tokens[at])}, id {ids[at]}) is {verb}"
    others = " (--pool mean or --pool last uses the others)" if offer and pool == "first" else ""
    return f"{_quote(word)} splits into {len(ids)} tokens ({pieces}); {what}{others}"


def spaced_form(word: str, ids: Sequence[int], encode: Callable[[str], list[int]]) -> int | None:
    """The token of ' word' when the word with a leading space is one token and the bare word is
    not (or is a much rarer piece): the spaced form is likely what was meant."""
    if not word or not word[0].isalnum() or not ids:
        return None
    spaced = encode(" " + word)
    if len(spaced) != 1 or list(ids) == spaced:
        return None
    if len(ids) == 1 and ids[0] < RARER * spaced[0]:
        return None
    return spaced[0]


def spaced_note(
    word: str,
    ids: Sequence[int],
    encode: Callable[[str], list[int]],
    text: Callable[[int], str],
    *,
    in_expression: bool = False,
) -> str | None:
    """A note suggesting ' word' when spaced_form finds it."""
    spaced = spaced_form(word, ids, encode)
    if spaced is None:
        return None
    form = text(spaced)
    other = f"{_quote(form)} (token {spaced}, with its leading space)"
    if len(ids) > 1:
        start = f"{_quote(word)} splits into {len(ids)} tokens, but {other} is one token"
    else:
        start = f"{_quote(word)} is token {ids[0]}, a rarer piece than {other}"
    how = f'"{_quote(form)}" (quoted in the expression)' if in_expression else _quote(form)
    return f"{start}: to use that, give {how}"


def word_notes(
    word: str,
    ids: Sequence[int],
    encode: Callable[[str], list[int]],
    text: Callable[[int], str],
    *,
    pool: str = "first",
    verb: str = "queried",
    offer_pool: bool = False,
    in_expression: bool = False,
) -> list[str]:
    """The notes for one typed word: how it split and what was used, and its spaced form."""
    notes = []
    if len(ids) > 1:
        tokens = [text(i) for i in ids]
        notes.append(split_note(word, tokens, ids, pool, verb, offer=offer_pool))
    spaced = spaced_note(word, ids, encode, text, in_expression=in_expression)
    if spaced is not None:
        notes.append(spaced)
    return notes
