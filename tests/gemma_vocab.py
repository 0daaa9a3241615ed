"""A Gemma-3-sized SentencePiece GGUF: 262,144 scored pieces, no merges (as Gemma 3's GGUF files
carry them), for measuring and testing what rebuilding such a tokenizer costs."""

from __future__ import annotations

import random
from pathlib import Path

GEMMA_SIZE = 262144
WORDS = ["king", "queen", "the", "water", "city", "北京", "四", "café", "running", "Überall"]


def gemma_like_vocab(n: int = GEMMA_SIZE) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types laid out as Gemma 3's: control tokens, unused
    (user-defined) ones, 256 byte pieces, then pieces grown BPE-like by joining two earlier
    pieces (so each has splits into vocabulary pieces), scored best-first."""
    control = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    tokens = control + [f"<unused{i}>" for i in range(99)]
    types = [3, 3, 3, 2, 3, 3, 3] + [4] * 99
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'-()"
    chars = ["▁", *letters, *"éèüößçñ", *(chr(c) for c in range(0x4E00, 0x4E00 + 2000))]
    pieces: list[str] = list(dict.fromkeys(chars))
    for word in WORDS:  # every prefix of '▁word' and of 'word', so the probes make whole pieces
        for form in (word, "▁" + word):
            pieces += [form[:i] for i in range(2, len(form) + 1)]
    pieces = list(dict.fromkeys(pieces))
    seen = set(pieces)
    rng = random.Random(27)
    short = list(pieces)
    while len(tokens) + len(pieces) < n:
        left = rng.choice(short) if rng.random() < 0.7 else rng.choice(pieces)
        right = rng.choice(short)
        if rng.random() < 0.5 and not left.startswith("▁"):
            left = "▁" + left if "▁" + left in seen else left
        piece = left + right
        if "▁" in piece[1:] or len(piece) > 16 or piece in seen:
            continue
        seen.add(piece)
        pieces.append(piece)
        if len(piece) <= 4:
            short.append(piece)
    tokens += pieces
    types += [1] * len(pieces)
    scores = [0.0] * (n - len(pieces)) + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types


def write_gemma_like_gguf(path: Path, n: int = GEMMA_SIZE) -> Path:
    """The GGUF file of gemma_like_vocab(n), with a small F16 embedding of n rows."""
    import gguf
    import numpy as np

    tokens, scores, types = gemma_like_vocab(n)
    tmp = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(tmp), "gemma3")
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_vocab_size(n)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_add_space_prefix(False)
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.normal(size=(n, 8)).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(path)
    return path
