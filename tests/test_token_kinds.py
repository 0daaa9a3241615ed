"""TokenKinds: ids with a kind each, as arrays, against the dicts they stand for."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from embedlens.analysis.vocab.kinds import TokenKinds
from embedlens.analysis.vocab.layout import _NEVER_PRODUCED, reference_rows

KINDS = ["unmerged", "shadowed", "single_byte", "partial_utf8", "byte_fallback", "padding"]
kinds_maps = st.dictionaries(st.integers(0, 5000), st.sampled_from(KINDS), max_size=200)


@given(kinds_maps)
def test_a_map_and_back(kinds):
    """Any id -> kind map, in any order, comes back ascending by id; counts are the map's."""
    held = TokenKinds.of(kinds)
    assert held.as_dict() == dict(sorted(kinds.items()))
    assert list(held.as_dict()) == sorted(kinds)
    assert held.counts() == {k: list(kinds.values()).count(k) for k in set(kinds.values())}
    assert len(held) == len(kinds)
    assert held == TokenKinds.of(dict(reversed(list(kinds.items()))))


@given(kinds_maps, st.integers(0, 6000), st.sets(st.sampled_from(KINDS)))
def test_below_and_only_are_the_maps_filtered(kinds, stop, wanted):
    held = TokenKinds.of(kinds)
    assert held.below(stop).as_dict() == {i: k for i, k in sorted(kinds.items()) if i < stop}
    assert held.only(wanted).as_dict() == {i: k for i, k in sorted(kinds.items()) if k in wanted}


@given(st.lists(kinds_maps, min_size=1, max_size=4))
def test_then_gives_each_id_the_last_kind_named(maps):
    merged: dict[int, str] = {}
    for m in maps:
        merged.update(m)
    first, *later = (TokenKinds.of(m) for m in maps)
    assert first.then(*later).as_dict() == dict(sorted(merged.items()))


@given(kinds_maps, st.integers(0, 300), st.integers(0, 300), st.lists(st.integers(0, 6000)))
def test_reference_rows_are_the_dicts_they_replaced(unreachable, size, extra, named):
    """What reference_rows gave as a dict: padding rows from `size`, then the tokens never
    produced, then the ones named unused (below the rows), each id the last kind named."""
    size = max(size, max(unreachable, default=-1) + 1)
    rows = size + extra
    want: dict[int, str] = dict.fromkeys(range(size, rows), "padding")
    want.update({i: k for i, k in unreachable.items() if k in _NEVER_PRODUCED})
    want.update(dict.fromkeys((i for i in named if i < rows), "named_unused"))
    got = reference_rows(size, TokenKinds.of(unreachable), rows, named)
    assert got.kinds.as_dict() == dict(sorted(want.items()))
    assert got.ids == sorted(want)


def test_equal_when_the_same_ids_have_the_same_kinds():
    a = TokenKinds.of({3: "unmerged", 1: "shadowed"})
    b = TokenKinds.one([1], "shadowed").then(TokenKinds.one([3], "unmerged"))
    assert a == b
    assert a != TokenKinds.of({3: "shadowed", 1: "shadowed"})
    assert a != TokenKinds.of({3: "unmerged"})
