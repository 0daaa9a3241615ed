"""Cosine nearest neighbours in the embedding (or head) matrix, and vector arithmetic.

All queries of one call are scored together: the matrix is read once, block by block, each block
widened to float32 and multiplied by the [d, q] matrix of normalised query vectors; dividing by
the block's row norms turns the dot products into cosines. Only real tokens are read and ranked:
rows at or beyond the tokenizer's length are padding, special tokens are left out unless asked
for, and a query's own rows (every word of an expression) are never its neighbours.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from embedlens.analysis.hub_reads import counts_hub_reads
from embedlens.errors import CheckpointError, EmbedlensError, UsageError
from embedlens.io.source import resolve as resolve_source
from embedlens.model import words
from embedlens.model.gguf_words import words_vocab
from embedlens.model.matrix import (
    Rows,
    Table,
    Which,
    check_matrix,
    check_row_range,
    locate,
    open_rows,
)
from embedlens.model.tokenizer import Vocab
from embedlens.model.words import Pool, check_pool, literal_note, pooled, unquoted
from embedlens.reports.neighbors import (
    Neighbor,
    NeighborsReport,
    QueryKind,
    QueryResult,
    Term,
)
from embedlens.reports.tokens import TokenRef

_OPERATOR = re.compile(r"\s[+-]\s")
_SPLIT = re.compile(r"(?:(?<=\s)|^)([+-])(?=\s|$)")


@dataclass(frozen=True)
class Query:
    """A query resolved to rows, before scoring."""

    text: str
    kind: QueryKind
    terms: list[Term]
    row: int | None = None

    @property
    def own_rows(self) -> list[int]:
        """Rows never reported as this query's neighbours: every row its vector is made of."""
        if self.row is not None:
            return [self.row]
        return list(dict.fromkeys(r for t in self.terms for r in t.rows))


def parse_expression(text: str) -> list[tuple[int, str]] | None:
    """Signed words of an expression ('king - man + woman'), or None for a plain word.

    An expression has a '+' or '-' with whitespace on both sides. Its words are stripped; a word
    in quotes keeps its text exactly ("' king' - ' man' + ' woman'").
    """
    typed = typed_terms(text)
    if typed is None:
        return None
    terms: list[tuple[int, str]] = []
    for s, word in typed:
        word = unquoted(word)
        if word == "":
            raise UsageError(
                f"cannot parse the expression '{text}': an operator has no word beside it",
                hint="write words joined by ' + ' and ' - ', e.g. \"king - man + woman\"",
            )
        terms.append((s, word))
    return terms


def typed_terms(text: str) -> list[tuple[int, str]] | None:
    """An expression's signed words as typed (stripped, quotes kept), or None for a plain word."""
    if not _OPERATOR.search(text):
        return None
    parts = _SPLIT.split(text.strip())  # [word, op, word, op, word, ...]
    signs = [1]
    if parts[0].strip() == "" and len(parts) > 1:  # a leading sign: '- man + woman'
        signs = [-1 if parts[1] == "-" else 1]
        parts = parts[2:]
    signs += [-1 if op == "-" else 1 for op in parts[1::2]]
    return [(s, w.strip()) for s, w in zip(signs, parts[0::2], strict=True)]


def literal_notes(vocab: Vocab, given: Sequence[str]) -> list[str]:
    """A note for each quoted word that is, quotes and all, a token of its own."""
    notes = []
    for text in given:
        typed = typed_terms(text)
        for word in [text] if typed is None else [w for _, w in typed]:
            found = literal_note(word, vocab.encode, vocab.text, "give --id {id}")
            if found is not None:
                notes.append(found)
    return list(dict.fromkeys(notes))


def _term(vocab: Vocab, sign: int, word: str, total: int, pool: str = "first") -> Term:
    ids = vocab.encode(word)
    if not ids:
        raise UsageError(f"'{word}' encodes to no tokens", hint="query a word, or a row with --id")
    if vocab.unk_id is not None and ids[0] == vocab.unk_id and vocab.lookup(word) is None:
        raise UsageError(
            f"'{word}' is not in the vocabulary: it encodes to the unknown token "
            f"'{vocab.text(vocab.unk_id)}'",
            hint="query a word the tokenizer knows, or a row with --id",
        )
    rows = pooled(ids, pool)
    for row in rows:
        if row >= total:
            raise UsageError(
                f"'{word}' is token {row}, which has no row: the matrix has {total:,} rows"
            )
    tokens = [TokenRef(i, vocab.text(i)) for i in ids]
    head = tokens[-1] if pool == "last" else tokens[0]
    return Term(sign, word, head.id, head.token, tokens, rows)


def word_notes(vocab: Vocab, queries: list[Query], pool: str) -> list[str]:
    """A note for each word that splits into several tokens (what was queried), and for each
    word typed without the leading space its likely meaning has."""
    notes: list[str] = []
    for q in queries:
        if q.kind == "id":
            continue
        for t in q.terms:
            ids = [x.id for x in t.tokens]
            notes += words.word_notes(
                t.text,
                ids,
                vocab.encode,
                vocab.text,
                pool=pool,
                offer_pool=True,
                in_expression=q.kind == "expression",
            )
    return list(dict.fromkeys(notes))


def check_row(row: int, real: int, total: int) -> None:
    """A row must be a real token's row: UsageError for negative, padding or beyond the matrix."""
    check_row_range(row, total)
    if row >= real:
        raise UsageError(
            f"row {row} is a padding row: the tokenizer has {real:,} tokens, rows from "
            f"{real:,} on belong to none",
            hint=f"query a row below {real:,}",
        )


def resolve(
    vocab: Vocab, words: list[str], ids: list[int], *, real: int, total: int, pool: str = "first"
) -> list[Query]:
    """Turn the words, expressions and --id rows given into queries (UsageError on bad input).

    A word of several tokens is queried by `pool`: its first token, the mean of all its tokens'
    unit rows, or its last token."""
    check_pool(pool)
    queries: list[Query] = []
    for text in words:
        if text == "":
            raise UsageError("empty query", hint="give a word, an expression, or --id ROW")
        signed = parse_expression(text)
        if signed is None:
            word = unquoted(text)
            queries.append(Query(word, "word", [_term(vocab, 1, word, total, pool)]))
        else:
            terms = [_term(vocab, s, w, total, pool) for s, w in signed]
            queries.append(Query(text, "expression", terms))
    for row in ids:
        check_row(row, real, total)
        text = vocab.text(row)
        term = Term(1, text, row, text, [TokenRef(row, text)], [row])
        queries.append(Query(str(row), "id", [term], row=row))
    if not queries:
        raise UsageError("no query given", hint="give a word, an expression, or --id ROW")
    return queries


def _word_vector(
    block: npt.NDArray[np.float64],
    norms: npt.NDArray[np.float64],
    where: dict[int, int],
    t: Term,
    tensor: str,
) -> npt.NDArray[np.float64]:
    """A word's unit vector: its row's, or the normalised mean of its tokens' unit rows."""
    vector = np.zeros(block.shape[1], dtype=np.float64)
    texts = {x.id: x.token for x in t.tokens}
    for row in t.rows:
        n = norms[where[row]]
        if not np.isfinite(block[where[row]]).all():
            raise CheckpointError(
                f"row {row} ('{texts.get(row, t.token)}') of '{tensor}' holds "
                f"{_nonfinite_kinds(block[where[row]])}: the table is corrupt there"
            )
        if n == 0:
            raise EmbedlensError(
                f"row {row} ('{texts.get(row, t.token)}') is all zeros: it has no direction to "
                "compare"
            )
        vector += block[where[row]] / n
    if len(t.rows) > 1:
        length = np.linalg.norm(vector)
        if length < 1e-6:
            raise UsageError(f"the unit rows of '{t.text}' add up to the zero vector")
        vector /= length
    return vector


def query_vectors(rows: Rows, queries: list[Query]) -> npt.NDArray[np.float32]:
    """[q, d]: each query's unit vector (an expression: the sum of its signed unit rows, normalised)."""
    needed = sorted({r for q in queries for t in q.terms for r in t.rows})
    block = rows.take(needed).astype(np.float64)
    norms = np.linalg.norm(block, axis=1)
    where = {row: i for i, row in enumerate(needed)}
    out = np.zeros((len(queries), rows.shape[1]), dtype=np.float64)
    for qi, q in enumerate(queries):
        for t in q.terms:
            out[qi] += t.sign * _word_vector(block, norms, where, t, rows.entry.name)
        total = np.linalg.norm(out[qi])
        if total < 1e-6:
            raise UsageError(
                f"'{q.text}' adds up to the zero vector: nothing to compare",
                hint="an expression whose words cancel out has no direction",
            )
        out[qi] /= total
    return out.astype(np.float32)


def _nonfinite_kinds(row: npt.NDArray[np.floating]) -> str:
    kinds = [k for k, bad in (("NaN", np.isnan(row).any()), ("inf", np.isinf(row).any())) if bad]
    return " and ".join(kinds) + " values"


def cosines(
    rows: Rows, vectors: npt.NDArray[np.float32], real: int
) -> tuple[npt.NDArray[np.float32], list[int]]:
    """[real, q]: cosine of every real token's row with every query vector (NaN for zero rows
    and for rows holding NaN or inf), and the ids of the rows holding NaN or inf.

    Finite rows whose squares or dot products overflow float32 (values near its largest) are
    scored again in float64, so that they get their true cosine rather than NaN.
    """
    out = np.empty((real, vectors.shape[0]), dtype=np.float32)
    qt = np.ascontiguousarray(vectors.T)
    broken: list[int] = []
    for start in range(0, real, rows.block_rows):
        stop = min(real, start + rows.block_rows)
        block = rows.block(start, stop)
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            norms = np.sqrt(np.einsum("ij,ij->i", block, block))
            dots = block @ qt
            bad: npt.NDArray[np.bool_] = np.zeros(len(block), dtype=bool)
            redo = ~(np.isfinite(norms) & np.isfinite(dots).all(axis=1))
            if redo.any():
                bad = np.asarray(~np.isfinite(block).all(axis=1))
                broken.extend(int(i) + start for i in np.flatnonzero(bad))
                redo &= ~bad
            if redo.any():
                wide = block[redo].astype(np.float64)
                norms[redo] = np.linalg.norm(wide, axis=1) / 2.0**64  # both scaled alike
                dots[redo] = (wide / 2.0**64) @ qt.astype(np.float64)
            np.divide(dots, norms[:, None], out=out[start:stop])
        out[start:stop][bad] = np.nan
    return out, broken


def top_k(
    scores: npt.NDArray[np.float32], allowed: npt.NDArray[np.bool_], own: list[int], k: int
) -> list[tuple[int, float]]:
    """The k best rows by score among the allowed ones, ties broken by id; rows whose cosine is
    not a number (a zero row, or one holding NaN) are never among them."""
    col = np.where(allowed & np.isfinite(scores), scores, -np.inf)
    for row in own:
        if row < col.shape[0]:
            col[row] = -np.inf
    k = min(k, int(np.count_nonzero(np.isfinite(col))))  # a row without a cosine never ranks
    if k <= 0:
        return []
    idx = np.argpartition(-col, k - 1)[:k] if k < col.shape[0] else np.arange(col.shape[0])
    order = np.lexsort((idx, -col[idx].astype(np.float64)))
    picked = idx[order][:k]
    return [(int(i), float(scores[i])) for i in picked]


def searchable(vocab: Vocab, real: int, *, include_special: bool) -> npt.NDArray[np.bool_]:
    """The rows searched: real tokens, without the special ones unless asked for."""
    allowed = np.ones(real, dtype=bool)
    if not include_special:
        specials = [i for i in vocab.special_ids if i < real]
        allowed[specials] = False
    return allowed


def neighbors_report(
    model: str,
    table: Table,
    rows: Rows,
    vocab: Vocab,
    queries: list[Query],
    allowed: npt.NDArray[np.bool_],
    *,
    k: int,
    include_special: bool,
    notes: list[str],
    pool: str = "first",
) -> NeighborsReport:
    """Score every query against the allowed rows in one pass over the matrix."""
    real = allowed.shape[0]
    scores, broken = cosines(rows, query_vectors(rows, queries), real)
    if broken:
        allowed = allowed.copy()
        allowed[broken] = False
        shown = ", ".join(str(i) for i in broken[:5]) + (", ..." if len(broken) > 5 else "")
        notes.append(
            f"{len(broken):,} rows of '{table.name}' hold NaN or inf values (a corrupt table) and "
            f"were left out of the search: {shown}"
        )
    results: list[QueryResult] = []
    for qi, q in enumerate(queries):
        best = top_k(scores[:, qi], allowed, q.own_rows, k)
        neighbors = [Neighbor(i, vocab.text(i), c) for i, c in best]
        head = q.terms[0]
        single = q.kind != "expression"
        results.append(
            QueryResult(
                query=q.text,
                kind=q.kind,
                token_id=head.token_id if single else None,
                token=head.token if single else None,
                tokens=list(head.tokens) if single else [t.tokens[0] for t in q.terms],
                split=any(len(t.tokens) > 1 for t in q.terms),
                terms=list(q.terms) if not single else [],
                neighbors=neighbors,
                pool=pool,
                rows=q.own_rows,
            )
        )
    specials = sum(1 for i in vocab.special_ids if i < real)
    return NeighborsReport(
        model=model,
        k=k,
        matrix=table.which,
        tensor=table.name,
        tied=table.tied,
        searched_rows=int(np.count_nonzero(allowed)),
        matrix_rows=table.rows,
        tokenizer_size=vocab.size,
        padding_rows=max(0, table.rows - real),
        special_excluded=0 if include_special else specials,
        include_special=include_special,
        queries=results,
        notes=[*notes, *word_notes(vocab, queries, pool)],
    )


@counts_hub_reads
def neighbors(
    model: str | os.PathLike[str],
    queries: str | Sequence[str] = (),
    *,
    top_k: int = 5,
    ids: Sequence[int] = (),
    matrix: Which = "input",
    include_special: bool = False,
    pool: Pool = "first",
    revision: str | None = None,
) -> NeighborsReport:
    """The nearest tokens to each query by cosine in the embedding (or head) matrix.

    queries: words, or expressions such as "king - man + woman" (a word wholly inside one pair
    of quotes is the text between them, its spaces kept: "' king'" is ' king'); ids: rows queried by id; matrix: "input" (the embedding) or "output" (the LM head);
    pool: how a word of several tokens is queried ("first", "mean" or "last" token).
    """
    if top_k < 1:
        raise UsageError(f"-k must be at least 1 (got {top_k})")
    which = check_matrix(matrix)
    check_pool(pool)
    spec = os.fspath(model)
    source = resolve_source(spec, revision)
    table = locate(source, which)
    vocab = words_vocab(source, table.checkpoint.gguf)
    real = min(vocab.size, table.rows)
    words_given = [queries] if isinstance(queries, str) else list(queries)
    found = resolve(vocab, words_given, list(ids), real=real, total=table.rows, pool=pool)
    allowed = searchable(vocab, real, include_special=include_special)
    searched = int(allowed.sum())
    if top_k > searched:
        raise UsageError(
            f"-k {top_k} is more than the {searched:,} rows searched",
            hint=f"use -k between 1 and {searched:,}",
        )
    notes = [*table.notes, *literal_notes(vocab, words_given)]
    if vocab.size > table.rows:
        notes.append(
            f"the tokenizer has {vocab.size:,} tokens but the matrix only {table.rows:,} "
            "rows: the tokens past them have no row"
        )
    return neighbors_report(
        spec,
        table,
        open_rows(source, table),
        vocab,
        found,
        allowed,
        k=top_k,
        include_special=include_special,
        notes=notes,
        pool=pool,
    )
