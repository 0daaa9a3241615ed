"""`tokenizers` Tokenizers built from a vocabulary's pieces as transformers builds a GGUF file's:
byte-level BPE with its pre-tokenizer's split, SentencePiece BPE (merges from scores when the file
has none), the file's control and user-defined tokens added."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from embedlens.model.gguf_vocab import CONTROL, USER_DEFINED
from embedlens.model.tokens import SPACE, byte_alphabet, outside_byte_alphabet

if TYPE_CHECKING:
    from tokenizers import Tokenizer

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
