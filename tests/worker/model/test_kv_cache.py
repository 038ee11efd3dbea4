"""The paged KV cache: slots, block gathers and token-range export/import."""

from __future__ import annotations

import pytest
import torch

from pdd.worker.model.config import tiny_config
from pdd.worker.model.kv_cache import KVLayout, PagedKVCache

pytestmark = pytest.mark.unit

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=3, dtype=torch.float32)


def token_kv(n: int, seed: int) -> torch.Tensor:
    """Distinct K/V for n tokens: [L, 2, n, Hkv, D]."""
    return torch.randn((2, 2, n, 2, 4), generator=torch.Generator().manual_seed(seed))


def test_layout_sizes() -> None:
    assert LAYOUT.bytes_per_token == 2 * 2 * 2 * 4 * 4
    assert LAYOUT.bytes_per_block == LAYOUT.bytes_per_token * 3
    bf16 = KVLayout.from_config(tiny_config(), 16, torch.bfloat16)
    assert bf16.bytes_per_token == tiny_config().kv_bytes_per_token(2)


def test_blocks_for_budget() -> None:
    assert PagedKVCache.blocks_for_budget(LAYOUT, LAYOUT.bytes_per_block * 7 + 5) == 7
    with pytest.raises(ValueError, match="below one block"):
        PagedKVCache.blocks_for_budget(LAYOUT, LAYOUT.bytes_per_block - 1)


def test_write_then_gather_follows_block_table() -> None:
    cache = PagedKVCache(LAYOUT, 6, "cpu")
    table = [4, 1]  # tokens 0-2 in block 4, tokens 3-4 in block 1
    k = torch.arange(5 * 2 * 4, dtype=torch.float32).view(5, 2, 4)
    slots = torch.tensor([12, 13, 14, 3, 4])
    cache.write(1, slots, k, -k)

    gk, gv = cache.gather(1, torch.tensor([table]))
    assert gk.shape == (1, 2, 6, 4)  # [B, Hkv, tokens, D]
    torch.testing.assert_close(gk[0, :, :5].transpose(0, 1), k)
    torch.testing.assert_close(gv[0, :, :5].transpose(0, 1), -k)
    assert cache.k[0].abs().sum() == 0  # other layers untouched


def test_read_and_write_tokens_round_trip_across_blocks() -> None:
    src, dst = PagedKVCache(LAYOUT, 6, "cpu"), PagedKVCache(LAYOUT, 6, "cpu")
    data = token_kv(7, seed=0)
    src.write_tokens([5, 0, 2], 0, data)
    # Export [2, 7) from one table and import it into another with different blocks.
    piece = src.read_tokens([5, 0, 2], 2, 7)
    torch.testing.assert_close(piece, data[:, :, 2:7])
    dst.write_tokens([1, 3, 4], 2, piece)
    torch.testing.assert_close(dst.read_tokens([1, 3, 4], 2, 7), data[:, :, 2:7])
    assert dst.read_tokens([1, 3, 4], 0, 2).abs().sum() == 0  # before start: untouched


def test_write_tokens_casts_to_cache_dtype() -> None:
    layout = KVLayout(2, 2, 4, 3, torch.bfloat16)
    cache = PagedKVCache(layout, 2, "cpu")
    cache.write_tokens([0], 0, token_kv(2, seed=1))
    assert cache.read_tokens([0], 0, 2).dtype == torch.bfloat16


def test_range_outside_table_is_refused() -> None:
    cache = PagedKVCache(LAYOUT, 4, "cpu")
    with pytest.raises(ValueError, match="outside the block table"):
        cache.read_tokens([0, 1], 4, 7)


def test_wrong_layout_import_is_refused() -> None:
    cache = PagedKVCache(LAYOUT, 4, "cpu")
    with pytest.raises(ValueError, match="does not fit layout"):
        cache.write_tokens([0], 0, torch.zeros(3, 2, 1, 2, 4))
