"""The `neighbors` report: nearest rows by cosine, for words, ids and vector arithmetic."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from embedlens.reports import Report
from embedlens.reports.tokens import TokenRef

QueryKind = Literal["word", "id", "expression"]


@dataclass(frozen=True)
class Neighbor:
    """One neighbour of a query."""

    id: int
    token: str
    cosine: float


@dataclass(frozen=True)
class Term:
    """One word of an expression like 'king - man + woman'."""

    sign: int
    """+1 or -1."""
    text: str
    token_id: int
    """The first token of the word's encoding: the row that is used."""
    token: str
    tokens: list[TokenRef]
    """The word's whole encoding."""
    rows: list[int] = field(default_factory=list)
    """The rows whose unit vectors make the word's vector (with --pool mean, all its tokens)."""


@dataclass(frozen=True)
class QueryResult:
    """A query and its neighbours, best first."""

    query: str
    """As given: the word, the expression, or the id for --id."""
    kind: QueryKind
    token_id: int | None
    """The row queried (None for an expression)."""
    token: str | None
    tokens: list[TokenRef]
    """The whole encoding of the query (for an expression: the row of each word)."""
    split: bool
    """The word (or a word of the expression) encodes to several tokens (see `pool`)."""
    terms: list[Term]
    neighbors: list[Neighbor]
    pool: str = "first"
    """How a word of several tokens is queried: first, mean (of their unit rows) or last."""
    rows: list[int] = field(default_factory=list)
    """Every row that went into the query vector (left out of its neighbours)."""


@dataclass(frozen=True)
class NeighborsReport(Report):
    """Nearest neighbours of each query among the real tokens' rows."""

    command: ClassVar[str] = "neighbors"
    model: str
    k: int
    matrix: Literal["input", "output"]
    tensor: str
    """The tensor searched."""
    tied: bool
    searched_rows: int
    """Rows searched: the real tokens (padding rows and, by default, special tokens excluded)."""
    matrix_rows: int
    """V: all rows of the matrix, padding included."""
    tokenizer_size: int
    padding_rows: int
    special_excluded: int
    include_special: bool
    queries: list[QueryResult]
    notes: list[str] = field(default_factory=list)
    hub_fetched_bytes: int | None = None
    """Bytes fetched from the hub by HTTP range for this report (headers and the rows read);
    None when nothing was read by range (a local model, or one whole in the hub cache)."""
