"""Token text as users should see it: exact decoded text, or the bytes when it is not UTF-8.

A byte-level BPE vocabulary stores each token as printable stand-ins for raw bytes ('Ġking' for
b' king'); SentencePiece stores '▁' for a space and '<0xE4>' for a lone byte. A token holding part
of a multi-byte character decodes to U+FFFD on its own; the contract shows its bytes instead.

From those pieces, `tokenizers` Tokenizers are built as transformers builds a GGUF file's:
byte-level BPE with its pre-tokenizer's split, SentencePiece BPE (merges from scores when the file
has none), the file's control and user-defined tokens added.
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, Any

from embedlens.errors import CheckpointError, UnsupportedError
from embedlens.model.gguf_vocab import CONTROL, USER_DEFINED, GGUFTokenizer
from embedlens.text import error_line

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from embedlens.io.gguf import GGUFHeader

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


def id_text(tokenizer: Any, token_id: int) -> str:
    """One token of a transformers tokenizer as text, as every command shows it (`token_text`
    of its lone decoding and its vocabulary entry)."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    decoded = tokenizer.decode([int(token_id)])
    return token_text(decoded, piece if isinstance(piece, str) else None)


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


# Split patterns for `tokenizer.ggml.pre` values whose merges were learned on a split other than
# GPT-2's (as transformers' GGUF loader sets them); any other value keeps GPT-2's byte-level split.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_GGUF_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}


def first_ids(tokens: list[str]) -> dict[str, int]:
    """Each entry's first id (a repeated entry's later ids lose), built at C speed."""
    return dict(zip(reversed(tokens), range(len(tokens) - 1, -1, -1), strict=True))


def build_gguf_tokenizer(header: GGUFHeader, meta: GGUFTokenizer, spelled: list[str]) -> Tokenizer:
    """The tokenizer of a GGUF vocabulary ('gpt2' or 'llama'), built from its arrays; a
    CheckpointError when the Rust side finds them inconsistent."""
    try:
        if meta.kind == "gpt2":
            assert meta.merges is not None, "vocab_from_gguf checks that it has merges"
            tok = byte_level_tokenizer(
                first_ids(spelled), meta.merges, header.metadata.get("tokenizer.ggml.pre")
            )
        else:
            add_space = header.metadata.get("tokenizer.ggml.add_space_prefix", True)
            scores = (
                None if meta.scores is None else dict(zip(meta.tokens, meta.scores, strict=False))
            )
            vocab = first_ids(meta.tokens)
            tok = sentencepiece_tokenizer(vocab, meta.merges, scores, add_space=bool(add_space))
        add_gguf_tokens(tok, meta.tokens, meta.types, byte_level=meta.kind == "gpt2")
    except (UnsupportedError, CheckpointError):
        raise
    except Exception as e:  # the Rust side raises bare Exceptions on inconsistent vocabularies
        raise CheckpointError(
            f"'{header.path.name}' has a corrupt tokenizer: {error_line(e)}"
        ) from e
    return tok


def partial_tokenizer(vocab: dict[str, int], *, byte_level: bool) -> Tokenizer:
    """A tokenizer of just these pieces (ids kept), decoding as the whole one decodes."""
    from tokenizers import Tokenizer, models

    if byte_level:
        spelling = byte_alphabet()
        alphabet = set(spelling.values())
        vocab = {_respelled(t, spelling, alphabet): i for t, i in vocab.items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.decoder = _byte_level_decoder() if byte_level else _sentencepiece_decoder()
    return tok


def byte_level_tokenizer(vocab: dict[str, int], merges: list[str], pre: object) -> Tokenizer:
    """A byte-level BPE tokenizer of these entries (spelled in the byte alphabet) and ids."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False)  # type: ignore[arg-type]
    tok = Tokenizer(bpe)
    split = _GGUF_SPLITS.get(str(pre))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = _byte_level_decoder()
    return tok


def byte_alphabet_spelling(tokens: list[str]) -> list[str]:
    """The tokens in the byte alphabet: those stored as text respelled."""
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    spelled = list(tokens)
    for i in outside_byte_alphabet(tokens):
        spelled[i] = _respelled(tokens[i], spelling, alphabet)
    return spelled


def _respelled(token: str, spelling: dict[int, str], alphabet: set[str]) -> str:
    """A byte-level token in the byte alphabet: a token stored as text is respelled."""
    if set(token) <= alphabet:
        return token
    return "".join(spelling[b] for b in token.encode("utf-8", "surrogateescape"))


def _byte_level_decoder() -> Any:
    from tokenizers import decoders

    return decoders.ByteLevel()


def _sentencepiece_decoder() -> Any:
    from tokenizers import decoders

    return decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )


def sentencepiece_tokenizer(
    vocab: dict[str, int],
    merges: list[str] | None,
    scores: dict[str, float] | None,
    *,
    add_space: bool,
) -> Tokenizer:
    """A SentencePiece BPE tokenizer of these entries and ids, built by `merges` or else by
    the merges `scores` imply."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    if merges is not None:
        pairs = [_merge_pair(m) for m in merges]
    else:
        assert scores is not None, "vocab_from_gguf checks for merges or scores"
        pairs = _merges_from_scores(vocab, scores)
    unk = "<unk>" if "<unk>" in vocab else None
    bpe = models.BPE(
        vocab=vocab,
        merges=pairs,
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPACE, prepend_scheme="first" if add_space else "never", split=False
    )
    tok.decoder = _sentencepiece_decoder()
    return tok


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a scored vocabulary: every split of a token into two tokens,
    best-scored token first (what transformers' generate_merges does)."""
    found: list[tuple[str, str, float]] = []
    for merged, score in scores.items():
        local = [
            (merged[:i], merged[i:], score)
            for i in range(1, len(merged))
            if merged[:i] in vocab and merged[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found.extend(local)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def add_gguf_tokens(
    tok: Tokenizer, tokens: list[str], types: list[int], *, byte_level: bool
) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens."""
    from tokenizers import AddedToken

    alphabet = set(byte_alphabet().values()) if byte_level else None
    control = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    if control:
        tok.add_special_tokens(control)
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == USER_DEFINED and tok.token_to_id(t) is not None
    ]
    if user:
        tok.add_tokens(user)


def _merge_pair(merge: str) -> tuple[str, str]:
    """A merge rule 'a b' as ('a', 'b')."""
    left, _, right = merge.partition(" ")
    return left, right
