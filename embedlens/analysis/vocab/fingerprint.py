"""A vocabulary's entries and bytes (`read_entries`: the tokenizer asked once) and its fingerprint:
SHA-256 of its id -> token-bytes list and special ids.

Each entry is hashed as the bytes it stands for (byte-level 'Ġking' as b' king', SentencePiece
'▁king' as b' king', '<0x41>' as b'A'), so a model's GGUF and tokenizer.json forms, which spell
their pieces alike, give the same fingerprint. A tokenizer hash stored in the weights' metadata
(a safetensors `__metadata__` or GGUF key naming the tokenizer and a hash) is compared with it.
"""

from __future__ import annotations

import hashlib
import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from embedlens.errors import EmbedlensError
from embedlens.io.checkpoint import read_safetensors_header
from embedlens.model.matrix import Table
from embedlens.model.tokenizer import Vocab
from embedlens.model.tokens import tokens_bytes
from embedlens.reports.vocab import Fingerprint

if TYPE_CHECKING:
    from tokenizers import Tokenizer

_HASH_KEY = re.compile(r"tokeni[sz]er.*(hash|sha|fingerprint)", re.IGNORECASE)
_PREFIX = b"embedlens-vocab-v1\n"


@dataclass(frozen=True)
class Entries:
    """A vocabulary's entries, read with its tokenizer once: every id's entry as stored (None for
    an id without one) and the bytes it stands for, in id order."""

    tokenizer: Tokenizer
    """The tokenizer they were read with (built, when only kept facts were read): the search
    for the tokens it never produces asks this one."""
    byte_level: bool
    """Whether the entries spell bytes in GPT-2's byte alphabet ('Ġking')."""
    pieces: list[str | None]
    raw: list[bytes]


def read_entries(vocab: Vocab) -> Entries:
    """Every id's entry and bytes, the tokenizer asked once."""
    whole = vocab.whole()
    tok = whole.tokenizer
    bl = "ByteLevel" in str(tok.decoder)
    pieces = _pieces(whole, tok)
    return Entries(tok, bl, pieces, tokens_bytes([p or "" for p in pieces], bl))


def pieces_by_id(vocab: Vocab) -> list[str | None]:
    """Every id's vocabulary entry as stored (None for an id without one), in one call."""
    whole = vocab.whole()
    return _pieces(whole, whole.tokenizer)


def _pieces(whole: Vocab, tok: Tokenizer) -> list[str | None]:
    """`pieces_by_id` of a vocabulary with its tokenizer built (`tok`, its tokenizer)."""
    if whole.pieces is not None:  # read with the GGUF: asking the tokenizer takes 0.5 s at 262k
        return list(whole.pieces)
    pieces: list[str | None] = [None] * whole.size
    for piece, i in tok.get_vocab(with_added_tokens=True).items():
        if 0 <= i < whole.size:
            pieces[i] = piece
    return pieces


def fingerprint(vocab: Vocab, raw: list[bytes] | None = None) -> str:
    """SHA-256 of the ids in order with each token's bytes (`raw`, when read already: as
    `read_entries` gives), then the special tokens' ids."""
    raw = raw if raw is not None else read_entries(vocab).raw
    blob = _entries_blob(raw)
    specials = b"".join(struct.pack("<I", i) for i in sorted(vocab.special_ids))
    return hashlib.sha256(_PREFIX + blob + b"special" + specials).hexdigest()


def _entries_blob(raw: list[bytes]) -> bytes:
    """Each id and its length as two little-endian uint32, then its bytes, for every id: laid
    out with numpy (a Python call per id costs a quarter of a second at 262k ids)."""
    import numpy as np

    n = len(raw)
    lengths = np.fromiter(map(len, raw), np.int64, n)
    heads = np.empty((n, 2), dtype="<u4")
    heads[:, 0] = np.arange(n)
    heads[:, 1] = lengths
    starts = np.cumsum(lengths + 8) - lengths - 8
    out = np.empty(int(lengths.sum()) + 8 * n, dtype=np.uint8)
    at = (starts[:, None] + np.arange(8)).ravel()
    out[at] = heads.view(np.uint8).ravel()
    body = np.ones(out.size, dtype=bool)
    body[at] = False
    out[body] = np.frombuffer(b"".join(raw), dtype=np.uint8)
    return out.tobytes()


def read_fingerprint(sha: str, table: Table) -> Fingerprint:
    """The fingerprint `sha`, and whether a tokenizer hash in the weights' metadata matches it."""
    key, value = metadata_hash(table)
    return Fingerprint(sha, key, value, None if value is None else same_hash(value, sha))


def metadata_hash(table: Table) -> tuple[str | None, str | None]:
    """A tokenizer hash stored in a GGUF's metadata or a safetensors file's __metadata__."""
    found: dict[str, object] = {}
    if table.checkpoint.gguf is not None:
        found = dict(table.checkpoint.gguf.metadata)
    elif table.entry.path is not None:
        kept = table.checkpoint.metadata.get(table.entry.file)  # read with the headers
        try:
            found = dict(
                kept if kept is not None else read_safetensors_header(table.entry.path).metadata
            )
        except EmbedlensError:
            found = {}
    for key, value in found.items():
        if _HASH_KEY.search(key) and isinstance(value, str):
            return key, value
    return None, None


def same_hash(stored: str, sha: str) -> bool:
    """Whether a stored hash ('sha256:…', or a prefix of 8 or more hex digits) names `sha`."""
    value = stored.strip().lower().removeprefix("sha256:")
    return value == sha or (len(value) >= 8 and sha.startswith(value))
