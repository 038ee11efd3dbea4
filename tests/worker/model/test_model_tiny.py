"""The built-in tiny preset: deterministic, byte-level, and usable in bf16 on the CPU."""

from __future__ import annotations

import pytest
import torch

from pdd.worker.model import LoadedModel, load_model
from pdd.worker.model.batch import ForwardBatch, InvalidBatchError, SeqInput
from pdd.worker.model.config import TINY_EOS_ID
from pdd.worker.model.kv_cache import PagedKVCache

pytestmark = pytest.mark.unit

BLOCK_SIZE = 16
TEXT = "The quick brown fox jumps over the lazy dog; naïve café."


def prompt_logits(loaded: LoadedModel, text: str = TEXT) -> torch.Tensor:
    ids = loaded.tokenizer.encode(text)
    kv = PagedKVCache(loaded.kv_layout(BLOCK_SIZE), 8, "cpu")
    table = list(range(-(-len(ids) // BLOCK_SIZE)))
    batch = ForwardBatch.build([SeqInput(ids, 0, table, all_logits=True)], BLOCK_SIZE, "cpu")
    return loaded.model(batch, kv)


def test_two_loads_give_identical_logits() -> None:
    assert torch.equal(prompt_logits(load_model("tiny")), prompt_logits(load_model("tiny")))


def test_tiny_preset_shape_and_tokens() -> None:
    loaded = load_model("tiny")
    cfg = loaded.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers) == (259, 128, 4)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 32)
    assert cfg.max_position_embeddings == 4096
    assert loaded.tokenizer.eos_token_ids == cfg.eos_token_ids == (TINY_EOS_ID,)
    assert loaded.dtype == torch.float32


def test_logits_are_not_degenerate() -> None:
    """Greedy decoding of the preset must not hinge on near-ties (demos compare streams)."""
    logits = prompt_logits(load_model("tiny"))
    top2 = logits.topk(2, dim=-1).values
    assert logits.std().item() > 0.5
    assert (top2[:, 0] - top2[:, 1]).median().item() > 1e-2


def test_bf16_cpu_forward_is_close_to_fp32() -> None:
    loaded = load_model("tiny", dtype="bf16")
    assert loaded.dtype == torch.bfloat16
    assert loaded.model.model.embed_tokens.weight.dtype == torch.bfloat16
    low, full = prompt_logits(loaded), prompt_logits(load_model("tiny"))
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, full, atol=0.15, rtol=0.05)
    assert (low.argmax(-1) == full.argmax(-1)).float().mean().item() > 0.9


def test_step_past_the_context_window_is_refused() -> None:
    loaded = load_model("tiny")
    limit = loaded.config.max_position_embeddings
    kv = PagedKVCache(loaded.kv_layout(BLOCK_SIZE), limit // BLOCK_SIZE + 1, "cpu")
    table = list(range(limit // BLOCK_SIZE + 1))
    batch = ForwardBatch.build([SeqInput([1], limit, table)], BLOCK_SIZE, "cpu")
    with pytest.raises(InvalidBatchError, match="context window is 4096"):
        loaded.model(batch, kv)
