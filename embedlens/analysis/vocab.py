"""`vocab`: is this vocabulary healthy, trained, and the one these weights were trained with?

The static parts read the headers, the tokenizer and one matrix (the head, or the embedding when
tied), never torch: the vocabulary against the matrices' rows, the tokens the tokenizer never
produces on its own, a fingerprint of the vocabulary, and the under-trained indicator
(`undertrained.py`); `--against` compares two vocabularies id by id (`vocabdiff.py`). `--verify`
and `--check-fit` load the model (`fit.py`).
"""

from __future__ import annotations

import functools
import hashlib
import re
import struct
from collections.abc import Callable
from pathlib import Path

from embedlens.analysis.undertrained import ReferenceRows, scan
from embedlens.analysis.vocabdiff import compare
from embedlens.errors import EmbedlensError, UsageError
from embedlens.matrix import Table, locate, open_rows
from embedlens.reports.vocab import (
    Fingerprint,
    Layout,
    TokenRef,
    Unreachable,
    UnreachableToken,
    VocabReport,
)
from embedlens.source import ModelSource, resolve
from embedlens.tokens import REPLACEMENT, byte_alphabet
from embedlens.vocab import Vocab, load_vocab, vocab_from_file

Progress = Callable[[int, int], None]

_SPACE = "\u2581"
_BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
# Entries a vocabulary itself names as unused or reserved: <unused12>, <|reserved_special_token_5|>,
# [unused7], <extra_id_3>.
_UNUSED_NAME = re.compile(r"^[<\[]\|?(unused|reserved|extra_id)[\w-]*\|?[>\]]$", re.IGNORECASE)
_HASH_KEY = re.compile(r"tokeni[sz]er.*(hash|sha|fingerprint)", re.IGNORECASE)
MAX_VERIFY = 20
LISTED = 100  # unreachable tokens listed per kind (all are counted)


def vocab(
    model: str,
    *,
    against: str | None = None,
    check_fit: bool = False,
    tokenizer: str | None = None,
    verify: bool = False,
    max_verify: int = MAX_VERIFY,
    all_tokens: bool = False,
    revision: str | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    trust_remote_code: bool = False,
    on_progress: Progress | None = None,
) -> VocabReport:
    """Check MODEL's vocabulary against its matrices, scan for under-trained tokens, and (on
    request) compare it with another vocabulary or measure whether the weights fit it."""
    if not isinstance(model, str):
        raise UsageError(
            "vocab reads MODEL from its files: give a hub repo id, a folder or a .gguf file",
            hint="a loaded model's vocabulary cannot be checked against its checkpoint",
        )
    if max_verify < 1:
        raise UsageError(f"--max-verify must be at least 1 (got {max_verify})")
    source = resolve(model, revision)
    table = locate(source, "output", trust_remote_code=trust_remote_code)
    if tokenizer is None:
        vocab_used = load_vocab(source, table.checkpoint.gguf)
        origin = vocab_used.origin
    else:
        vocab_used, origin = load_other(tokenizer), tokenizer
    other = load_other(against) if against is not None else None
    layout = read_layout(vocab_used, table)
    problems = layout_problems(layout)
    unreachable, unreachable_kinds = find_unreachable(vocab_used, min(vocab_used.size, table.rows))
    pieces = pieces_by_id(vocab_used)
    prints = read_fingerprint(vocab_used, source, table, pieces)
    if prints.matches is False:
        problems.append(
            f"the weights' metadata names tokenizer hash {prints.metadata_value} "
            "but this vocabulary's fingerprint differs"
        )
    rows = open_rows(source, table)
    reference = reference_rows(vocab_used, unreachable_kinds, table.rows, pieces)
    scanned = scan(rows, table, vocab_used, reference, all_tokens=all_tokens)
    model_obj = None
    if check_fit or (verify and scanned.candidates):
        from embedlens.analysis import fit as fitting

        model_obj = fitting.load(
            source, dtype=dtype, device=device, trust_remote_code=trust_remote_code
        )
        if verify:
            scanned = fitting.verify_candidates(
                model_obj, vocab_used, scanned, max_verify=max_verify, on_progress=on_progress
            )
    diff = None
    if other is not None and against is not None:
        diff = compare(vocab_used, other, against, fingerprint=prints)
        problems.extend(diff.summary if not diff.compatible else [])
    fit = None
    if check_fit:
        fit = fitting.check_fit(model_obj, vocab_used, tokenizer or "model", rows=table.rows)
        if not fit.fits:
            bad = ", ".join(x.language for x in fit.languages if not x.fits)
            problems.append(
                f"the weights do not fit this tokenizer ({bad}): its ids score no better than "
                "ids shifted by one"
            )
    notes = [] if table.tied else list(table.notes)
    if vocab_used.size > table.rows:
        notes.append("tokens past the last row are left out of the scan")
    return VocabReport(
        model=model,
        tokenizer=origin,
        layout=layout,
        fingerprint=prints,
        unreachable=unreachable,
        undertrained=scanned,
        against=diff,
        fit=fit,
        problems=problems,
        notes=notes,
    )


def load_other(spec: str) -> Vocab:
    """Another vocabulary: a tokenizer.json, a folder holding one, or any MODEL."""
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".json":
        return vocab_from_file(path)
    if (
        path.is_dir()
        and (path / "tokenizer.json").is_file()
        and not (path / "config.json").is_file()
    ):
        return vocab_from_file(path / "tokenizer.json")
    return load_vocab(resolve(spec))


# --- the vocabulary against the matrices ---------------------------------------------------------


def added_ids(vocab: Vocab) -> list[int]:
    """Ids of the tokens added on top of the tokenizer's model (specials included), sorted."""
    return sorted(vocab.tokenizer.get_added_tokens_decoder())


def read_layout(vocab: Vocab, table: Table) -> Layout:
    """Sizes, padding and missing rows, special tokens, and where the added tokens sit."""
    inv = table.checkpoint.tensors
    embedding = _embedding_entry(table)
    added = added_ids(vocab)
    placement, inserted = _placement(added, vocab.size)
    specials = sorted(vocab.special_ids | set(added))
    return Layout(
        tokenizer_size=vocab.size,
        embedding_tensor=embedding,
        embedding_rows=inv[embedding].shape[0],
        head_tensor=table.name,
        head_rows=table.rows,
        width=table.width,
        tied=table.tied,
        padding_rows=max(0, min(table.rows, inv[embedding].shape[0]) - vocab.size),
        missing_rows=max(0, vocab.size - min(table.rows, inv[embedding].shape[0])),
        special_tokens=[TokenRef(i, vocab.text(i)) for i in specials if i in vocab.special_ids],
        added_tokens=len(added),
        added_placement=placement,
        inserted=[TokenRef(i, vocab.text(i)) for i in inserted],
    )


def _embedding_entry(table: Table) -> str:
    if table.tied or table.which == "input":
        return table.name
    from embedlens.inventory import from_checkpoint

    inv = from_checkpoint(table.checkpoint, table.config)
    assert inv.embedding is not None
    return inv.embedding


def _placement(added: list[int], size: int) -> tuple[str, list[int]]:
    """Where the added tokens sit among the ordinary ones, and those with ordinary ids both sides."""
    if not added:
        return "none", []
    taken = set(added)
    ordinary = [i for i in range(size) if i not in taken]
    if not ordinary:
        return "start", []
    low, high = ordinary[0], ordinary[-1]
    inside = [i for i in added if low < i < high]
    if inside:
        return "inside", inside
    at_start = any(i < low for i in added)
    at_end = any(i > high for i in added)
    return ("start and end" if at_start and at_end else "start" if at_start else "end"), []


def layout_problems(layout: Layout) -> list[str]:
    """What in the layout makes the model misbehave."""
    problems: list[str] = []
    if layout.missing_rows:
        problems.append(
            f"{layout.missing_rows:,} tokens have no row: the tokenizer has "
            f"{layout.tokenizer_size:,} tokens, the matrices {min(layout.embedding_rows, layout.head_rows):,} "
            "rows; looking them up fails"
        )
    if layout.embedding_rows != layout.head_rows:
        problems.append(
            f"the embedding has {layout.embedding_rows:,} rows but the head {layout.head_rows:,}"
        )
    if layout.inserted:
        first = layout.inserted[0].id
        problems.append(
            f"{len(layout.inserted)} added tokens sit inside the ordinary range (from id {first}): "
            f"if they were inserted after training, every id after them moved and looks up its "
            "neighbour's row (check with --check-fit, or --against the original tokenizer)"
        )
    return problems


# --- tokens never produced -----------------------------------------------------------------------


def find_unreachable(vocab: Vocab, n: int) -> tuple[Unreachable, dict[int, str]]:
    """Ordinary tokens (ids below n) that decoding and encoding again does not give back: the
    report (the first LISTED of each kind listed) and every such id with its kind."""
    tok = vocab.tokenizer
    skip = set(added_ids(vocab)) | vocab.special_ids
    ids = [i for i in range(n) if i not in skip]
    texts = tok.decode_batch([[i] for i in ids], skip_special_tokens=False)
    encodings = tok.encode_batch(texts, add_special_tokens=False)
    found: list[tuple[int, str, list[int]]] = []
    metaspace, bl = _metaspace(vocab), byte_level(vocab)
    piece_of = tok.id_to_token
    for i, text, enc in zip(ids, texts, encodings, strict=True):
        got = enc.ids
        if len(got) == 1 and got[0] == i:
            continue
        piece = piece_of(i) or ""
        if metaspace and not piece.startswith(_SPACE) and REPLACEMENT not in text:
            # A piece without '▁' never starts a word: encoding it alone adds the '▁'. Ask the
            # model's merges directly whether they build it.
            got = [t.id for t in tok.model.tokenize(piece)]
            if got == [i]:
                continue
        found.append((i, _kind(piece, text, bl), list(got)))
    by_kind: dict[str, int] = {}
    listed: list[UnreachableToken] = []
    for i, kind, got in found:
        by_kind[kind] = by_kind.get(kind, 0) + 1
        if by_kind[kind] <= LISTED:
            listed.append(UnreachableToken(i, vocab.text(i), kind, got))
    report = Unreachable(len(found), dict(sorted(by_kind.items())), listed)
    return report, {i: kind for i, kind, _ in found}


def _metaspace(vocab: Vocab) -> bool:
    pre = vocab.tokenizer.pre_tokenizer
    return pre is not None and ("Metaspace" in type(pre).__name__ or _SPACE in str(pre))


def _kind(piece: str, text: str, byte_level: bool) -> str:
    if _BYTE_PIECE.match(piece):
        return "byte_fallback" if int(piece[3:5], 16) < 0x80 else "single_byte"
    if REPLACEMENT in text and REPLACEMENT not in piece:
        return "single_byte" if len(token_bytes(piece, byte_level)) == 1 else "partial_utf8"
    return "shadowed"


def reference_rows(
    vocab: Vocab, unreachable: dict[int, str], rows: int, pieces: list[str | None]
) -> ReferenceRows:
    """Rows known unused: padding, tokens never produced as themselves, tokens named unused."""
    ids: dict[int, str] = {i: "padding" for i in range(vocab.size, rows)}
    for i, kind in unreachable.items():
        if kind in ("single_byte", "shadowed", "byte_fallback"):
            ids[i] = kind
    for i, piece in enumerate(pieces[:rows]):
        if piece is not None and piece[:1] in "<[" and _UNUSED_NAME.match(piece):
            ids[i] = "named_unused"
    return ReferenceRows(ids)


# --- fingerprint ---------------------------------------------------------------------------------


@functools.cache
def _byte_table() -> dict[int, int]:
    """str.translate table from byte-level stand-ins to the code points of their bytes."""
    return {ord(ch): b for b, ch in byte_alphabet().items()}


def byte_level(vocab: Vocab) -> bool:
    """Whether the vocabulary spells bytes in GPT-2's byte alphabet ('Ġking')."""
    return "ByteLevel" in str(vocab.tokenizer.decoder)


def token_bytes(piece: str | None, byte_level: bool) -> bytes:
    """A vocabulary entry's bytes: byte-level and <0xNN> pieces as their bytes, '▁' as a space."""
    if piece is None:
        return b""
    if piece.startswith("<0x") and _BYTE_PIECE.match(piece):
        return bytes([int(piece[3:5], 16)])
    if byte_level:
        try:
            return piece.translate(_byte_table()).encode("latin-1")
        except UnicodeEncodeError:  # an added token stored as plain text
            pass
    return piece.replace(_SPACE, " ").encode("utf-8", "surrogateescape")


def pieces_by_id(vocab: Vocab) -> list[str | None]:
    """Every id's vocabulary entry as stored (None for an id without one), in one call."""
    pieces: list[str | None] = [None] * vocab.size
    for piece, i in vocab.tokenizer.get_vocab(with_added_tokens=True).items():
        if 0 <= i < vocab.size:
            pieces[i] = piece
    return pieces


def fingerprint(vocab: Vocab, pieces: list[str | None] | None = None) -> str:
    """SHA-256 of the ids in order with each token's bytes, then the special tokens' ids."""
    digest = hashlib.sha256(b"embedlens-vocab-v1\n")
    pack = struct.Struct("<II").pack
    bl = byte_level(vocab)
    pieces = pieces if pieces is not None else pieces_by_id(vocab)
    for i in range(vocab.size):
        raw = token_bytes(pieces[i], bl)
        digest.update(pack(i, len(raw)) + raw)
    digest.update(b"special")
    for i in sorted(vocab.special_ids):
        digest.update(struct.pack("<I", i))
    return digest.hexdigest()


def read_fingerprint(
    vocab: Vocab, source: ModelSource, table: Table, pieces: list[str | None]
) -> Fingerprint:
    """The fingerprint, and whether a tokenizer hash in the weights' metadata matches it."""
    sha = fingerprint(vocab, pieces)
    key, value = _metadata_hash(source, table)
    return Fingerprint(sha, key, value, None if value is None else _same_hash(value, sha))


def _metadata_hash(source: ModelSource, table: Table) -> tuple[str | None, str | None]:
    """A tokenizer hash stored in a GGUF's metadata or a safetensors file's __metadata__."""
    found: dict[str, object] = {}
    if table.checkpoint.gguf is not None:
        found = dict(table.checkpoint.gguf.metadata)
    elif table.entry.path is not None:
        from embedlens.checkpoint import read_safetensors_header

        try:
            found = dict(read_safetensors_header(table.entry.path).metadata)
        except EmbedlensError:
            found = {}
    for key, value in found.items():
        if _HASH_KEY.search(key) and isinstance(value, str):
            return key, value
    return None, None


def _same_hash(stored: str, sha: str) -> bool:
    value = stored.strip().lower().removeprefix("sha256:")
    return value == sha or (len(value) >= 8 and sha.startswith(value))
