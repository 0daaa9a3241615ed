"""Token text as users should see it: exact decoded text, or the bytes when it is not UTF-8.

A byte-level BPE vocabulary stores each token as printable stand-ins for raw bytes ('Ġking' for
b' king'); SentencePiece stores '▁' for a space and '<0xE4>' for a lone byte. A token holding part
of a multi-byte character decodes to U+FFFD on its own; the contract shows its bytes instead.
"""

from __future__ import annotations

import functools
import re

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
REPLACEMENT = "\ufffd"
SPACE = "\u2581"  # SentencePiece's stand-in for a space


@functools.cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's bytes_to_unicode table: each byte's printable stand-in in byte-level vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """The inverse of byte_alphabet()."""
    return {c: b for b, c in byte_alphabet().items()}


def piece_bytes(piece: str) -> bytes | None:
    """The raw bytes behind a vocabulary piece, if the piece encodes bytes; else None."""
    match = _BYTE_PIECE.match(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    table = _byte_decoder()
    if piece and all(ch in table for ch in piece):
        return bytes(table[ch] for ch in piece)
    return None


@functools.cache
def _to_latin1() -> tuple[dict[int, int], re.Pattern[str]]:
    """str.translate table from byte-level stand-ins to the code points of their bytes, and a
    pattern that finds a character outside the byte alphabet."""
    alphabet = byte_alphabet()
    outside = re.compile("[^" + re.escape("".join(alphabet.values())) + "]")
    return {ord(ch): b for b, ch in alphabet.items()}, outside


def token_bytes(piece: str, byte_level: bool) -> bytes:
    """A vocabulary entry's bytes: <0xNN> pieces and (in a byte-level vocabulary) pieces spelled
    in the byte alphabet as their bytes, anything else as UTF-8 with SentencePiece's '▁' as a
    space. As piece_bytes, without a Python call per character (a 262k vocabulary at once)."""
    if piece.startswith("<0x") and _BYTE_PIECE.match(piece):
        return bytes([int(piece[3:5], 16)])
    if byte_level:
        table, outside = _to_latin1()
        if piece and outside.search(piece) is None:
            return piece.translate(table).encode("latin-1")
    return piece.replace(SPACE, " ").encode("utf-8", "surrogateescape")


def tokens_bytes(pieces: list[str], byte_level: bool) -> list[bytes]:
    """token_bytes of every piece, a byte-level vocabulary translated all at once (each
    byte-alphabet character is one byte); pieces spelled otherwise one by one."""
    if not byte_level:
        return [token_bytes(p, False) for p in pieces]
    raw, ends, odd = _translated(pieces)
    out = [raw[a:b] for a, b in zip([0, *ends][:-1], ends, strict=True)]
    for i in odd:
        out[i] = token_bytes(pieces[i], True)
    return out


def outside_byte_alphabet(pieces: list[str]) -> set[int]:
    """The indices of the pieces holding a character outside the byte alphabet."""
    return _translated(pieces, byte_pieces=False)[2]


def _translated(
    pieces: list[str], *, byte_pieces: bool = True
) -> tuple[bytes, list[int], set[int]]:
    """The pieces joined with each byte-alphabet character as its byte (anything else as '?'),
    where each piece ends in it, and the pieces to spell one by one: those holding a character
    outside the alphabet, and (with `byte_pieces`) those spelled '<0x..>'. One numpy lookup over
    every code point instead of a Python call per piece."""
    import numpy as np

    table = _to_latin1()[0]
    lookup = np.full(max(table) + 1, -1, dtype=np.int16)
    lookup[list(table)] = list(table.values())
    lengths = np.fromiter(map(len, pieces), np.int64, len(pieces))
    codes = np.frombuffer("".join(pieces).encode("utf-32-le", "surrogatepass"), "<u4")
    mapped = lookup[np.minimum(codes, lookup.size - 1)]
    bad = (mapped < 0) | (codes >= lookup.size)
    mapped[bad] = ord("?")
    odd = set(np.unique(np.repeat(np.arange(len(pieces)), lengths)[bad]).tolist())
    ends = np.cumsum(lengths)
    if byte_pieces and codes.size:
        first = codes[np.minimum(ends - lengths, codes.size - 1)]
        maybe = np.flatnonzero((lengths == 6) & (first == ord("<"))).tolist()
        odd.update(i for i in maybe if pieces[i].startswith("<0x"))
    return mapped.astype(np.uint8).tobytes(), ends.tolist(), odd


def show_bytes(raw: bytes) -> str:
    """Valid UTF-8 runs as text, every other byte as \\xNN."""
    return raw.decode("utf-8", errors="backslashreplace")


def token_text(decoded: str, piece: str | None) -> str:
    """One token as users see it, from its decoded text and its vocabulary entry: the text a
    lone token decodes to (a SentencePiece decoder strips a first token's leading space: a
    token stored with '▁' keeps it, unless the decoder kept the '▁' itself), its bytes when
    decoding lost them."""
    if piece is not None and piece.startswith(SPACE) and not decoded.startswith((" ", SPACE)):
        decoded = " " + decoded
    return readable(decoded, piece)


def readable(decoded: str, piece: str | None = None) -> str:
    """The decoded text of one token; its bytes instead when decoding lost them to U+FFFD."""
    if REPLACEMENT not in decoded or (piece is not None and REPLACEMENT in piece):
        return decoded
    raw = piece_bytes(piece) if piece is not None else None
    if raw is not None:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return show_bytes(raw)
    return decoded.replace(REPLACEMENT, "\\ufffd")
