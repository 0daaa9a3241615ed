"""Tiny random models of several architectures, saved as a hub checkout is laid out.

Each family is described by a plain config dict (as config.json would hold it); `build` makes the
model with random weights under a fixed seed, saves it with safetensors and a WordLevel tokenizer,
and returns the folder. `hub_cache` lays such a folder out as huggingface_hub's cache does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

WORDS = (
    "the a of to and in is was he she it king queen man woman prince princess boy girl "
    "Paris France Berlin Germany Rome Italy capital city cat dog cats dogs one two three four "
    "red green blue big small good bad run walk sun moon water fire tree house car road "
    "book word"
).split()
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
TOKENIZER_LEN = len(SPECIALS) + len(WORDS)
VOCAB = 72  # > TOKENIZER_LEN: the rows past the tokenizer are padding, as in Qwen3 or Pythia

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
    "max_position_embeddings": 64,
}
_LLAMA_LIKE: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
}

FAMILIES: dict[str, dict[str, Any]] = {
    "llama-tied": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], **_LLAMA_LIKE,
        "tie_word_embeddings": True,
    },
    "llama-untied": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], **_LLAMA_LIKE,
        "tie_word_embeddings": False,
    },
    "qwen3": {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **_LLAMA_LIKE,
        "head_dim": 8, "tie_word_embeddings": True,
    },
    "gpt2": {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 32, "n_layer": 3,
        "n_head": 4, "n_positions": 64, "tie_word_embeddings": True,
    },
    "gpt-neox": {
        "model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "tie_word_embeddings": False,
    },
    "opt": {
        # word_embed_proj_dim < hidden_size adds project_in / project_out; post-norm blocks and
        # do_layer_norm_before=False leave the decoder without a final norm (as OPT-350m).
        "model_type": "opt", "architectures": ["OPTForCausalLM"], "hidden_size": 32,
        "ffn_dim": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "word_embed_proj_dim": 16, "do_layer_norm_before": False, "tie_word_embeddings": True,
    },
    "gemma2": {
        "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], **_LLAMA_LIKE,
        "head_dim": 8, "final_logit_softcapping": 3.0, "attn_logit_softcapping": 50.0,
        "query_pre_attn_scalar": 8, "sliding_window": 16, "tie_word_embeddings": True,
    },
    "phi3": {
        "model_type": "phi3", "architectures": ["Phi3ForCausalLM"], **_LLAMA_LIKE,
        "num_key_value_heads": 4, "tie_word_embeddings": False,
    },
    "qwen3-moe": {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], **_LLAMA_LIKE,
        "head_dim": 8, "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
    },
    "cohere": {
        "model_type": "cohere", "architectures": ["CohereForCausalLM"], **_LLAMA_LIKE,
        "logit_scale": 0.25, "tie_word_embeddings": True,
    },
    "phi": {
        # Phi-1/2: LayerNorm, parallel blocks, and a head with a bias.
        "model_type": "phi", "architectures": ["PhiForCausalLM"], "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "tie_word_embeddings": False,
    },
}  # fmt: skip
for _cfg in FAMILIES.values():
    for _k, _v in _COMMON.items():
        _cfg.setdefault(_k, _v)


def write_tokenizer(folder: Path) -> None:
    """A WordLevel tokenizer over WORDS, saved as tokenizer.json with its config."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.chat_template = (
        "{% for m in messages %}<s> {{ m['content'] }} </s> {% endfor %}"
        "{% if add_generation_prompt %}<s> {% endif %}"
    )
    fast.save_pretrained(folder)


def build(family: str, folder: Path, *, seed: int = 0, max_shard_size: str | None = None) -> Path:
    """Build a tiny random model of a family and save it (weights, config, tokenizer)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(FAMILIES[family])
    model_type = raw.pop("model_type")
    config = AutoConfig.for_model(model_type, **raw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(folder, **kwargs)
    write_tokenizer(folder)
    return folder


def hub_cache(folder: Path, hf_home: Path, repo_id: str, *, sha: str = "0" * 40) -> Path:
    """Lay a model folder out as huggingface_hub's cache: blobs, snapshots, refs/main."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / sha
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(sha)
    for i, f in enumerate(sorted(p for p in folder.iterdir() if p.is_file())):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    return snapshot


def write_config(folder: Path, config: dict[str, Any]) -> Path:
    """Write a config.json alone (for --meta-only)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder
