"""The `vocab` report: the vocabulary against the matrices, under-trained tokens, drift checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from embedlens.reports import Report


@dataclass(frozen=True)
class TokenRef:
    """One token: its id and exact text."""

    id: int
    token: str


@dataclass(frozen=True)
class Layout:
    """The tokenizer's ids against the rows of the embedding and the head."""

    tokenizer_size: int
    """len(tokenizer): ids 0 to tokenizer_size - 1."""
    embedding_tensor: str
    embedding_rows: int
    head_tensor: str
    """The head's tensor (the embedding's name when the head is tied)."""
    head_rows: int
    width: int
    tied: bool
    padding_rows: int
    """Rows past the tokenizer: no token ever looks them up."""
    missing_rows: int
    """Tokens with no row: looking them up fails (an error the model would hit)."""
    special_tokens: list[TokenRef]
    added_tokens: int
    """Tokens added on top of the tokenizer's model (specials included)."""
    added_placement: str
    """'none', 'start', 'end', 'start and end' or 'inside' (among the ordinary tokens' ids)."""
    inserted: list[TokenRef]
    """Added tokens with ordinary tokens on both sides: every later id moved if they were inserted."""


@dataclass(frozen=True)
class Fingerprint:
    """SHA-256 of the vocabulary, and the tokenizer hash found in the weights' metadata, if any."""

    sha256: str
    metadata_key: str | None
    metadata_value: str | None
    matches: bool | None
    """Whether the metadata hash equals the fingerprint (None when there is none)."""


@dataclass(frozen=True)
class UnreachableToken:
    """A token that decoding and encoding its text again does not give back."""

    id: int
    token: str
    kind: str
    """'single_byte', 'partial_utf8', 'byte_fallback', 'shadowed' or 'unmerged'."""
    encodes_as: list[int]


@dataclass(frozen=True)
class Unreachable:
    """Tokens the tokenizer never produces on their own."""

    count: int
    by_kind: dict[str, int]
    tokens: list[UnreachableToken]
    """The first 100 of each kind."""


@dataclass(frozen=True)
class Candidate:
    """A token whose row looks like the unused rows'."""

    id: int
    token: str
    indicator: float
    norm: float
    special: bool
    repeat_prob: float | None
    """With --verify: the highest probability the model gives the token when asked to repeat it."""
    verdict: str
    """'candidate' (not verified), 'confirmed' (repeat_prob below 1%) or 'rejected'."""


@dataclass(frozen=True)
class Undertrained:
    """The Fishing-for-Magikarp indicator over the head's rows (the embedding when tied)."""

    matrix: str
    """'output' (the head) or 'input' (the embedding, when the head is tied to it)."""
    tensor: str
    reference_count: int
    reference_by_kind: dict[str, int]
    threshold: float | None
    """Candidates have an indicator at or above it (None: no reference rows, no indicator)."""
    threshold_rule: str
    component: str
    """How the first principal component was found (exactly, or by Lanczos and how closely)."""
    counts: dict[str, int]
    """Tokens per verdict: 'reference', 'candidate', 'confirmed', 'rejected', 'ok'."""
    norm_median: float
    reference_norm_median: float | None
    identical_rows: list[list[int]]
    """Groups of rows that are exactly equal (rows never moved apart by training)."""
    candidates: list[Candidate]
    """Best first, all of them (the table shows the first few)."""
    verified: int
    """How many candidates --verify asked the model about."""
    indicators: list[float] | None = None
    """With --all (or --json): every row's indicator, by id (null for an all-zero row)."""
    norms: list[float] | None = None


@dataclass(frozen=True)
class Shift:
    """A block of ids that moved by the same amount between the two vocabularies."""

    start: int
    stop: int
    """Inclusive, in this model's ids."""
    by: int
    count: int


@dataclass(frozen=True)
class Renamed:
    """The same id spells a different token in the other vocabulary (and not by a shift)."""

    id: int
    token: str
    other_token: str


@dataclass(frozen=True)
class VocabDiff:
    """This vocabulary against another, id by id."""

    other: str
    other_size: int
    other_fingerprint: str
    identical: bool
    compatible: bool
    """Every token here keeps its id in the other (which may append tokens after them)."""
    same_ids: int
    """Tokens at the same id in both."""
    added: int
    """Tokens only in the other vocabulary."""
    removed: int
    """Tokens only in this one."""
    renamed: int
    shifted: int
    """Tokens found in both at different ids."""
    shifts: list[Shift]
    added_examples: list[TokenRef]
    removed_examples: list[TokenRef]
    renamed_examples: list[Renamed]
    summary: list[str]


@dataclass(frozen=True)
class FitLanguage:
    """Mean next-token loss on one built-in text, with its ids as given and shifted by one."""

    language: str
    tokens: int
    loss: float
    shifted_loss: float
    uniform_loss: float
    """ln(V): what a model that knows nothing scores."""
    fits: bool


@dataclass(frozen=True)
class Fit:
    """Do these weights fit this tokenizer?"""

    tokenizer: str
    """'model' (its own) or the --tokenizer given."""
    margin: float
    """A language fits when shifted_loss - loss is at least this (nats)."""
    languages: list[FitLanguage]
    fits: bool


@dataclass(frozen=True)
class VocabReport(Report):
    """Is this vocabulary healthy, trained, and the one these weights were trained with?"""

    command: ClassVar[str] = "vocab"
    model: str
    tokenizer: str
    """Where the vocabulary came from: 'tokenizer.json', 'GGUF metadata', or --tokenizer's path."""
    layout: Layout
    fingerprint: Fingerprint
    unreachable: Unreachable
    undertrained: Undertrained
    against: VocabDiff | None
    fit: Fit | None
    problems: list[str]
    """What would make the model misbehave with this vocabulary (empty: none found)."""
    notes: list[str] = field(default_factory=list)
    hub_fetched_bytes: int | None = None
    """Bytes fetched from the hub by HTTP range for this report (headers and the rows read);
    None when nothing was read by range (a local model, or one whole in the hub cache)."""
