"""The `vocab` report: the vocabulary against the matrices, under-trained tokens, drift checks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from embedlens.reports import SHOWN_ONLY, Report
from embedlens.reports.tokens import TokenRef


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
class RowFigures:
    """One token's row in one matrix: the figures each signal reads, and the signals it trips."""

    indicator: float
    norm: float
    norm_score: float
    """Robust score of the row's log norm: (log norm - median) / (1.4826 x MAD), over the
    reachable ordinary rows."""
    mean_distance: float
    """Distance to the rows' mean over the ordinary rows' median distance to it."""
    signals: list[str]


@dataclass(frozen=True)
class Candidate:
    """A token whose row looks under-trained: like the unused rows', or never moved from its start."""

    id: int
    token: str
    indicator: float
    norm: float
    special: bool
    repeat_prob: float | None
    """With --verify: the highest probability the model gives the token when asked to repeat it."""
    verdict: str
    """'candidate' (not verified), 'confirmed' (repeat_prob below 1%) or 'rejected'."""
    signals: list[str] = field(default_factory=list)
    """What flagged it, in any matrix: 'indicator' (Magikarp's), 'norm' (far from the ordinary
    rows' norms), 'mean' (at the mean of the rows, as transformers' mean resizing leaves a row)."""
    by_matrix: dict[str, list[str]] = field(default_factory=dict)
    """The signals each scanned matrix flagged it by ('input', 'output'; empty: not flagged)."""
    norm_score: float = math.nan
    mean_distance: float = math.nan
    input: RowFigures | None = None
    """Untied models: the embedding's row (the fields above are the head's)."""


@dataclass(frozen=True)
class MatrixScan:
    """The scan of one matrix: the Magikarp indicator, the norm and mean signals, equal rows."""

    matrix: str
    """'output' (the head) or 'input' (the embedding)."""
    tensor: str
    threshold: float | None
    threshold_rule: str
    component: str
    norm_median: float
    reference_norm_median: float | None
    identical_rows: list[list[int]]
    norm_rule: str
    norm_low: float | None
    norm_high: float | None
    """The norm signal flags rows with a norm at or below norm_low or at or above norm_high."""
    ordinary_rows: int
    """Reachable ordinary tokens (not special, added, unreachable or reference): what the norm
    and mean signals measure rows against."""
    ordinary_norm_median: float | None
    mean_rule: str
    mean_distance_median: float | None
    """The ordinary rows' median distance to the rows' mean."""
    flagged: dict[str, int]
    """Rows of tokens this matrix flags, by signal."""
    indicators: list[float] | None = None
    norms: list[float] | None = None


@dataclass(frozen=True)
class GroupMatrix:
    """A group of rows in one matrix."""

    matrix: str
    norm_median: float
    ordinary_norm_median: float | None
    flagged: int
    """Rows of the group any signal flags."""
    by_signal: dict[str, int]
    verdict: str
    """'untrained' (more than half flagged), 'partly untrained' or 'ordinary' (none flagged)."""


@dataclass(frozen=True)
class RowGroup:
    """Rows added at the end of the table, checked together."""

    kind: str
    """'added_tokens' (added tokens past the last ordinary id) or 'past_tokenizer' (rows no
    token looks up)."""
    first: int
    last: int
    count: int
    matrices: list[GroupMatrix]
    verdict: str
    """'untrained' when the rows look untrained in a matrix, 'partly untrained', or 'ordinary'."""
    summary: str


@dataclass(frozen=True)
class Undertrained:
    """Rows that look under-trained: the Fishing-for-Magikarp indicator, and rows whose norm or
    place (at the rows' mean) says they never moved. The flat figures are the head's (the
    embedding's when tied); an untied model's embedding is scanned too (`input`)."""

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
    """All of them, the signals taking turns (each strongest first; the table shows the first few)."""
    verified: int
    """How many candidates --verify asked the model about."""
    indicators: list[float] | None = None
    """With --all (or --json): every row's indicator, by id (null for an all-zero row)."""
    norms: list[float] | None = None
    norm_rule: str = ""
    norm_low: float | None = None
    norm_high: float | None = None
    ordinary_rows: int = 0
    ordinary_norm_median: float | None = None
    mean_rule: str = ""
    mean_distance_median: float | None = None
    flagged: dict[str, int] = field(default_factory=dict)
    """Rows of tokens the head (the embedding when tied) flags, by signal."""
    by_signal: dict[str, int] = field(default_factory=dict)
    """Candidates per signal, in any matrix."""
    input: MatrixScan | None = None
    """Untied models: the embedding's scan."""
    one_matrix: dict[str, int] | None = None
    """Untied models: candidates flagged in that matrix only ('input', 'output')."""
    groups: list[RowGroup] = field(default_factory=list)


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
    """The blocks of ids that moved together (empty when the vocabularies are unrelated)."""
    added_examples: list[TokenRef]
    removed_examples: list[TokenRef]
    renamed_examples: list[Renamed]
    summary: list[str]
    unrelated: bool = False
    """Most tokens both hold sit at different ids, one by one rather than in shifted blocks:
    not one vocabulary changed, but another one."""


@dataclass(frozen=True)
class FitLanguage:
    """Mean next-token loss on one built-in text: with its ids as given, shifted by one, and
    against what the model scores with its own tokenizer (or a trained model is expected to)."""

    language: str
    tokens: int
    loss: float
    shifted_loss: float
    uniform_loss: float
    """ln(V): what a model that knows nothing scores."""
    fits: bool
    """Shifting the ids costs at least the margin, and `rise` is at most `threshold`."""
    own_tokens: int | None
    """The text's tokens with the model's own tokenizer (None when it cannot be read)."""
    own_loss: float | None
    """The mean loss with the model's own tokenizer (None when it cannot be read)."""
    reference_loss: float
    """What `loss` is judged against: `own_loss`, or the loss expected of a trained model."""
    rise: float
    """How much more the text costs than the reference, in nats per token of the reference's
    reading (with the own tokenizer: the whole text's extra nats over its own tokens)."""
    threshold: float
    """The most `rise` that fits."""


@dataclass(frozen=True)
class Fit:
    """Do these weights fit this tokenizer?"""

    tokenizer: str
    """'model' (its own) or the --tokenizer given."""
    margin: float
    """Shifting a text's ids by one must cost at least this (nats) for it to fit."""
    languages: list[FitLanguage]
    fits: bool
    reference: str
    """'own_tokenizer' (the model's own tokenizer on the same text) or 'expectation' (a
    calibrated loss: the model's own tokenizer is the one checked, or cannot be read)."""


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
    shows_all: bool = field(default=False, metadata=SHOWN_ONLY)
    """Whether the tables list every candidate (--all), not the first few; how the report is
    shown, so not in `to_dict()`, which always holds every candidate and every row's figures."""
