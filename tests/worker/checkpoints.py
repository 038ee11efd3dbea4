"""Tiny random-weight Hugging Face checkpoints written by transformers itself.

Tests load these with our loader and with transformers, so parity is checked against
the reference implementation on files in the real on-disk format (config.json as
transformers 5 writes it, single or sharded safetensors, a tokenizer.json).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from pdd.testing.tokenizers import train_byte_bpe

ARCH_CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}

BASE_CONFIG: dict[str, Any] = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
}

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Prefill, relay decode and main decode share one prefix cache.",
    "Über naïve café: UTF-8 bytes survive byte-level BPE 🙂",
] * 20


def write_hf_checkpoint(
    tmp_path: Path,
    arch: str,
    *,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> Path:
    """Write a random ``arch`` ("llama", "qwen2", "qwen3") checkpoint; returns its dir.

    ``overrides`` are config fields (e.g. ``rope_parameters``, ``tie_word_embeddings``);
    ``max_shard_size`` small enough (e.g. "40KB") forces a sharded checkpoint with an
    index. Weights are re-drawn at trained-model scale (transformers' 0.02 init makes
    near-uniform logits that would hide bugs under any tolerance), with norms and
    biases away from 1 and 0 so a weight that is not loaded shows.
    """
    import transformers

    config_cls = getattr(transformers, ARCH_CONFIGS[arch])
    config = config_cls(**{**BASE_CONFIG, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    _randomize(model, seed)
    model = model.to(dtype)
    out = tmp_path / f"{arch}-ckpt"
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kwargs)
    build_tokenizer(config.vocab_size).save(str(out / "tokenizer.json"))
    return out


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on a small corpus; ids 0 and 1 are <s> and </s>."""
    return train_byte_bpe(_CORPUS, vocab_size, ["<s>", "</s>"], bos="<s>")


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
