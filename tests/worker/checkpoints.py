"""Tiny random-weight Hugging Face checkpoints written by transformers itself.

Tests load these with our loader and with transformers, so parity is checked against
the reference implementation on files in the real on-disk format (config.json as
transformers 5 writes it, single or sharded safetensors, a tokenizer.json).
"""

from __future__ import annotations

import math
import random
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


#: Ids 0 and 1 are <s> and </s>; the synthetic corpus uses the rest.
_FIRST_WORD_ID = 2


class SyntheticCorpus:
    """Token sequences with a trained model's kind of structure, generated in code.

    A bank of "phrases" (fixed runs of 2-8 token ids) is drawn once; a sequence is a
    chain of phrases, each picked by a Zipf law conditioned on the phrase before it,
    and now and then a phrase from earlier in the same sequence comes back (so
    attention over the context, i.e. the KV, decides some tokens). A model trained on
    it has what random weights lack: most next tokens nearly certain (inside a
    phrase), some spread over a few likely ones (at phrase boundaries).
    """

    def __init__(self, vocab_size: int, seed: int = 0, phrases: int = 96) -> None:
        rng = random.Random(seed)
        words = range(_FIRST_WORD_ID, vocab_size)
        self.phrases = [
            [rng.choice(words) for _ in range(rng.randint(2, 8))] for _ in range(phrases)
        ]
        # Each phrase's likely successors: 6 phrases with Zipf weights 1, 1/2, ... 1/6.
        self.successors = [rng.sample(range(phrases), 6) for _ in range(phrases)]

    def sample(self, length: int, seed: int) -> list[int]:
        """One sequence of exactly ``length`` ids (deterministic in ``seed``, which must be
        non-negative: ``random.Random`` seeds -n and n alike)."""
        rng = random.Random(seed)
        out: list[int] = []
        used: list[int] = []
        phrase = rng.randrange(len(self.phrases))
        while len(out) < length:
            out += self.phrases[phrase]
            used.append(phrase)
            if len(used) > 2 and rng.random() < 0.2:
                phrase = rng.choice(used[:-1])  # a phrase from earlier in the sequence
            else:
                weights = [1 / (k + 1) for k in range(len(self.successors[phrase]))]
                phrase = rng.choices(self.successors[phrase], weights)[0]
        return out[:length]


def train_hf_checkpoint(
    tmp_path: Path, arch: str, *, steps: int = 200, seed: int = 0, **overrides: Any
) -> Path:
    """A small ``arch`` checkpoint trained ``steps`` steps on ``SyntheticCorpus``.

    Same shape as ``write_hf_checkpoint`` (transformers' own init, float32), trained on
    the CPU in about a minute, so its next-token distributions are peaked the way a trained
    model's are and its top two logits are rarely tied (what a lossy KV codec's
    greedy agreement depends on). Deterministic in ``seed`` on one machine.
    """
    import transformers

    config_cls = getattr(transformers, ARCH_CONFIGS[arch])
    config = config_cls(**{**BASE_CONFIG, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    corpus = SyntheticCorpus(config.vocab_size, seed)
    optim = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=5e-3, total_steps=steps)
    model.train()
    for step in range(steps):
        batch = torch.tensor([corpus.sample(128, seed=step * 8 + i) for i in range(8)])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        sched.step()
        optim.zero_grad()
    model.eval()
    out = tmp_path / f"{arch}-trained"
    model.save_pretrained(out)
    build_tokenizer(config.vocab_size).save(str(out / "tokenizer.json"))
    return out


#: Sample seeds from here on are the prompts'; training draws ``steps * 8`` below it.
_HELD_OUT_SEED = 10**9


def corpus_prompts(vocab_size: int, count: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of 60-120 tokens from the corpus ``train_hf_checkpoint(...,
    seed=seed)`` learned, sampled with seeds its training never used (held out)."""
    corpus, rng = SyntheticCorpus(vocab_size, seed), random.Random(seed)
    return [corpus.sample(rng.randrange(60, 120), seed=_HELD_OUT_SEED + i) for i in range(count)]
