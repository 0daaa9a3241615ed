"""Tiny GGUF models that transformers loads and the lens runs: one block of random float32
weights under a vocabulary given whole (SentencePiece or byte-level BPE)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, CONTEXT = 32, 4, 2, 8, 64, 256

_BLOCK = {
    "llama": ("attn_norm", "ffn_norm"),
    "gemma3": ("attn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm", "ffn_norm",
               "post_ffw_norm"),
}  # fmt: skip
"""Each architecture's norms in a block (its matrices are the same)."""


@dataclass
class Vocabulary:
    """A GGUF tokenizer: its model ('llama' or 'gpt2'), entries, token types and the rest."""

    model: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    bos: int | None = None
    eos: int | None = None
    unk: int | None = None
    flags: dict[str, bool] = field(default_factory=dict)
    """tokenizer.ggml.add_bos_token, add_eos_token, add_space_prefix (by their last word)."""
    pre: str | None = None


def write_tiny_gguf(path: Path, arch: str, vocab: Vocabulary, *, seed: int = 0) -> Path:
    """A one-block `arch` model ('llama' or 'gemma3') of random weights with this vocabulary."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(1)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if arch == "gemma3":
        writer.add_sliding_window(CONTEXT)
    writer.add_vocab_size(len(vocab.tokens))
    _add_vocabulary(writer, vocab)
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> Any:
        return (rng.normal(size=(rows, cols)) * 0.2).astype(np.float32)

    writer.add_tensor("token_embd.weight", matrix(len(vocab.tokens), HIDDEN))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    for name in _BLOCK[arch]:
        width = HEAD_DIM if name in ("attn_q_norm", "attn_k_norm") else HIDDEN
        writer.add_tensor(f"blk.0.{name}.weight", np.ones(width, dtype=np.float32))
    shapes = {
        "attn_q": (HEADS * HEAD_DIM, HIDDEN),
        "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_output": (HIDDEN, HEADS * HEAD_DIM),
        "ffn_gate": (FFN, HIDDEN),
        "ffn_up": (FFN, HIDDEN),
        "ffn_down": (HIDDEN, FFN),
    }
    for name, (rows, cols) in shapes.items():
        writer.add_tensor(f"blk.0.{name}.weight", matrix(rows, cols))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_vocabulary(w: Any, vocab: Vocabulary) -> None:
    """The tokenizer's metadata, as llama.cpp's converter writes it."""
    w.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    if vocab.scores is not None:
        w.add_token_scores(vocab.scores)
    if vocab.merges is not None:
        w.add_token_merges(vocab.merges)
    for name, value in (("bos", vocab.bos), ("eos", vocab.eos), ("unk", vocab.unk)):
        if value is not None:
            getattr(w, f"add_{name}_token_id")(value)
    for flag, value in vocab.flags.items():
        getattr(w, f"add_{flag}")(value)


def gemma_vocabulary(n: int = 4000) -> Vocabulary:
    """Gemma 3's shape (tests/gemma_vocab.py): control tokens, byte pieces, scored pieces; BOS
    added, no space prefix."""
    from tests.gemma_vocab import gemma_like_vocab

    tokens, scores, types = gemma_like_vocab(n)
    return Vocabulary(
        "llama", tokens, types, scores=scores, bos=2, eos=1, unk=3,
        flags={"add_bos_token": True, "add_eos_token": False, "add_space_prefix": False},
    )  # fmt: skip


def byte_level_vocabulary() -> Vocabulary:
    """SmolLM2's shape: a byte-level BPE trained on a few sentences, '<|endoftext|>',
    '<|im_start|>' and '<|im_end|>' first (control), no BOS added."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    text = [
        "The capital of France is Paris. The capital of Italy is Rome.",
        "The king and the queen live in the capital city, by the water.",
        "café 北京 running Überall",
    ]
    tok.train_from_iterator(text * 5, trainer)
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    merges = [" ".join(pair) for pair in _merges(tok)]
    types = [3 if t in special else 1 for t in tokens]
    return Vocabulary(
        "gpt2", tokens, types, merges=merges, bos=1, eos=2, unk=0, pre="smollm",
        flags={"add_bos_token": False, "add_space_prefix": False},
    )  # fmt: skip


def _merges(tok: Any) -> list[tuple[str, str]]:
    import json

    model = json.loads(tok.to_str())["model"]
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
