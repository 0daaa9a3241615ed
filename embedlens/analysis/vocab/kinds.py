"""Token ids with a kind each, as arrays: why a row is unused, or why a token never comes back.

A vocabulary of 262,144 tokens can have as many such ids ('unmerged', 'padding', ...). As a dict
they took tens of milliseconds to build, and as long again to count and to turn back into the
arrays the scan works on; here they stay arrays from the tokenizer cache to the scan.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True, eq=False)
class TokenKinds:
    """`ids` ascending, without repeats; `codes[k]`, the index in `names` of ids[k]'s kind.
    Equal to another when the same ids have the same kinds."""

    ids: npt.NDArray[np.int64]
    codes: npt.NDArray[np.uint8]
    names: tuple[str, ...]

    @classmethod
    def of(cls, kinds: Mapping[int, str]) -> TokenKinds:
        """From id -> kind, in any order (`names` sorted)."""
        names = tuple(sorted(set(kinds.values())))
        code = {name: k for k, name in enumerate(names)}
        ids = np.fromiter(kinds, dtype=np.int64, count=len(kinds))
        codes = np.fromiter((code[v] for v in kinds.values()), dtype=np.uint8, count=len(kinds))
        order = np.argsort(ids, kind="stable")
        return cls(ids[order], codes[order], names)

    @classmethod
    def one(cls, ids: Iterable[int], kind: str) -> TokenKinds:
        """These ids (ascending), all of one kind."""
        held = np.fromiter(ids, dtype=np.int64)
        return cls(held, np.zeros(held.size, dtype=np.uint8), (kind,))

    def __len__(self) -> int:
        return int(self.ids.size)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TokenKinds):
            return NotImplemented
        return np.array_equal(self.ids, other.ids) and self._named() == other._named()

    __hash__ = None  # type: ignore[assignment]  # mutable arrays inside

    def _named(self) -> list[str]:
        names = self.names
        return [names[c] for c in self.codes.tolist()]

    def as_dict(self) -> dict[int, str]:
        """id -> kind, ascending by id."""
        return dict(zip(self.ids.tolist(), self._named(), strict=True))

    def counts(self, below: int | None = None) -> dict[str, int]:
        """How many ids of each kind (of the ids below `below`, when given), by kind name (kinds
        with none left out)."""
        codes = self.codes if below is None else self.below(below).codes
        n = np.bincount(codes, minlength=len(self.names))
        return {name: int(n[k]) for k, name in enumerate(self.names) if n[k]}

    def below(self, stop: int) -> TokenKinds:
        """The ids below `stop`."""
        end = int(np.searchsorted(self.ids, stop))
        if end == self.ids.size:
            return self
        return TokenKinds(self.ids[:end], self.codes[:end], self.names)

    def only(self, kinds: Iterable[str]) -> TokenKinds:
        """The ids whose kind is among `kinds`."""
        asked = set(kinds)
        wanted = [k for k, name in enumerate(self.names) if name in asked]
        if len(wanted) == len(self.names):
            return self
        keep = np.isin(self.codes, np.asarray(wanted, dtype=np.uint8))
        return TokenKinds(self.ids[keep], self.codes[keep], self.names)

    def then(self, *later: TokenKinds) -> TokenKinds:
        """These and the `later` ones, an id's kind the last given for it."""
        parts = [self, *later]
        names = tuple(sorted({n for p in parts for n in p.names}))
        code = {name: k for k, name in enumerate(names)}
        ids = np.concatenate([p.ids for p in parts])
        codes = np.concatenate(
            [np.asarray([code[n] for n in p.names], dtype=np.uint8)[p.codes] for p in parts]
        )
        if np.all(ids[1:] > ids[:-1]):  # given in order, none twice: nothing to sort
            return TokenKinds(ids, codes, names)
        # np.unique keeps each id's first place: in reversed order, that is the last one given.
        unique, first = np.unique(ids[::-1], return_index=True)
        return TokenKinds(unique, codes[::-1][first], names)
