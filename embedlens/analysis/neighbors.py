"""Cosine nearest neighbours in the embedding (or head) matrix, and vector arithmetic.

All queries of one call are scored together: the matrix is read once, block by block, each block
widened to float32 and multiplied by the [d, q] matrix of normalised query vectors; dividing by
the block's row norms turns the dot products into cosines. Only real tokens are read and ranked:
rows at or beyond the tokenizer's length are padding, special tokens are left out unless asked
for, and a query's own rows (every word of an expression) are never its neighbours.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from embedlens.errors import CheckpointError, EmbedlensError, UsageError
from embedlens.matrix import Rows, Table, check_row_range
from embedlens.reports.neighbors import (
    Neighbor,
    NeighborsReport,
    QueryKind,
    QueryResult,
    Term,
    TokenRef,
)
from embedlens.vocab import Vocab

_OPERATOR = re.compile(r"\s[+-]\s")
_SPLIT = re.compile(r"(?:(?<=\s)|^)([+-])(?=\s|$)")
_QUOTED = re.compile(r"^(['\"])(.*)\1$", re.DOTALL)


@dataclass(frozen=True)
class Query:
    """A query resolved to rows, before scoring."""

    text: str
    kind: QueryKind
    terms: list[Term]
    row: int | None = None

    @property
    def own_rows(self) -> list[int]:
        """Rows never reported as this query's neighbours."""
        return [self.row] if self.row is not None else [t.token_id for t in self.terms]


def parse_expression(text: str) -> list[tuple[int, str]] | None:
    """Signed words of an expression ('king - man + woman'), or None for a plain word.

    An expression has a '+' or '-' with whitespace on both sides. Its words are stripped; a word
    in quotes keeps its text exactly ("' king' - ' man' + ' woman'").
    """
    if not _OPERATOR.search(text):
        return None
    parts = _SPLIT.split(text.strip())  # [word, op, word, op, word, ...]
    signs = [1]
    if parts[0].strip() == "" and len(parts) > 1:  # a leading sign: '- man + woman'
        signs = [-1 if parts[1] == "-" else 1]
        parts = parts[2:]
    words = parts[0::2]
    signs += [-1 if op == "-" else 1 for op in parts[1::2]]
    terms: list[tuple[int, str]] = []
    for s, word in zip(signs, words, strict=True):
        word = word.strip()
        quoted = _QUOTED.match(word)
        if quoted:
            word = quoted.group(2)
        if word == "":
            raise UsageError(
                f"cannot parse the expression '{text}': an operator has no word beside it",
                hint="write words joined by ' + ' and ' - ', e.g. \"king - man + woman\"",
            )
        terms.append((s, word))
    return terms


def _term(vocab: Vocab, sign: int, word: str, total: int) -> Term:
    ids = vocab.encode(word)
    if not ids:
        raise UsageError(f"'{word}' encodes to no tokens", hint="query a word, or a row with --id")
    if vocab.unk_id is not None and ids[0] == vocab.unk_id and vocab.lookup(word) is None:
        raise UsageError(
            f"'{word}' is not in the vocabulary: it encodes to the unknown token "
            f"'{vocab.text(vocab.unk_id)}'",
            hint="query a word the tokenizer knows, or a row with --id",
        )
    if ids[0] >= total:
        raise UsageError(
            f"'{word}' is token {ids[0]}, which has no row: the matrix has {total:,} rows"
        )
    tokens = [TokenRef(i, vocab.text(i)) for i in ids]
    return Term(sign, word, ids[0], tokens[0].token, tokens)


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
    vocab: Vocab, words: list[str], ids: list[int], *, real: int, total: int
) -> list[Query]:
    """Turn the words, expressions and --id rows given into queries (UsageError on bad input)."""
    queries: list[Query] = []
    for text in words:
        if text == "":
            raise UsageError("empty query", hint="give a word, an expression, or --id ROW")
        signed = parse_expression(text)
        if signed is None:
            queries.append(Query(text, "word", [_term(vocab, 1, text, total)]))
        else:
            terms = [_term(vocab, s, w, total) for s, w in signed]
            queries.append(Query(text, "expression", terms))
    for row in ids:
        check_row(row, real, total)
        text = vocab.text(row)
        term = Term(1, text, row, text, [TokenRef(row, text)])
        queries.append(Query(str(row), "id", [term], row=row))
    if not queries:
        raise UsageError("no query given", hint="give a word, an expression, or --id ROW")
    return queries


def query_vectors(rows: Rows, queries: list[Query]) -> npt.NDArray[np.float32]:
    """[q, d]: each query's unit vector (an expression: the sum of its signed unit rows, normalised)."""
    needed = sorted({t.token_id for q in queries for t in q.terms})
    block = rows.take(needed).astype(np.float64)
    norms = np.linalg.norm(block, axis=1)
    where = {row: i for i, row in enumerate(needed)}
    out = np.zeros((len(queries), rows.shape[1]), dtype=np.float64)
    for qi, q in enumerate(queries):
        for t in q.terms:
            n = norms[where[t.token_id]]
            if not np.isfinite(block[where[t.token_id]]).all():
                raise CheckpointError(
                    f"row {t.token_id} ('{t.token}') of '{rows.entry.name}' holds "
                    f"{_nonfinite_kinds(block[where[t.token_id]])}: the table is corrupt there"
                )
            if n == 0:
                raise EmbedlensError(
                    f"row {t.token_id} ('{t.token}') is all zeros: it has no direction to compare"
                )
            out[qi] += t.sign * block[where[t.token_id]] / n
        total = np.linalg.norm(out[qi])
        if total < 1e-6:
            raise EmbedlensError(f"'{q.text}' adds up to the zero vector: nothing to compare")
        out[qi] /= total
    return out.astype(np.float32)


def _nonfinite_kinds(row: npt.NDArray[np.floating]) -> str:
    kinds = [k for k, bad in (("NaN", np.isnan(row).any()), ("inf", np.isinf(row).any())) if bad]
    return " and ".join(kinds) + " values"


def cosines(
    rows: Rows, vectors: npt.NDArray[np.float32], real: int
) -> tuple[npt.NDArray[np.float32], list[int]]:
    """[real, q]: cosine of every real token's row with every query vector (NaN for zero rows
    and for rows holding NaN or inf), and the ids of the rows holding NaN or inf."""
    out = np.empty((real, vectors.shape[0]), dtype=np.float32)
    qt = np.ascontiguousarray(vectors.T)
    broken: list[int] = []
    for start in range(0, real, rows.block_rows):
        stop = min(real, start + rows.block_rows)
        block = rows.block(start, stop)
        with np.errstate(over="ignore", invalid="ignore"):
            norms = np.sqrt(np.einsum("ij,ij->i", block, block))
            dots = block @ qt
        bad = ~np.isfinite(norms)
        if bad.any():  # NaN and inf reach the norm (an overflow to inf marks a huge row too)
            bad = ~np.isfinite(block).all(axis=1)
            broken.extend(int(i) + start for i in np.flatnonzero(bad))
        with np.errstate(divide="ignore", invalid="ignore"):
            np.divide(dots, norms[:, None], out=out[start:stop])
        out[start:stop][bad] = np.nan
    return out, broken


def top_k(
    scores: npt.NDArray[np.float32], allowed: npt.NDArray[np.bool_], own: list[int], k: int
) -> list[tuple[int, float]]:
    """The k best rows by score among the allowed ones, ties broken by id."""
    col = np.where(allowed, scores, -np.inf)
    col = np.where(np.isnan(col), -np.inf, col)
    for row in own:
        if row < col.shape[0]:
            col[row] = -np.inf
    candidates = int(np.count_nonzero(allowed)) - sum(
        1 for r in set(own) if r < allowed.shape[0] and allowed[r]
    )
    k = min(k, candidates)
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
        notes=notes,
    )
