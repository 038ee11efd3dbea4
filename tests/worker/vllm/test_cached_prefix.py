"""``cached_prefix.CachedPrefix``: the hit a vLLM receiver answers, from vLLM's KV events
renamed into the router's blocks. No vLLM needed."""

from __future__ import annotations

import pytest

from pdd.common.block_hash import block_hashes
from pdd.common.cache_events import AllCleared, BlockRemoved, BlockStored
from pdd.worker.vllm.cached_prefix import CachedPrefix

pytestmark = pytest.mark.unit

TOKENS = list(range(100, 150))  # 50 tokens: three full blocks of 16 and a tail


def test_the_hit_is_the_leading_run_of_stored_blocks_in_whole_blocks() -> None:
    cached = CachedPrefix(16, 16)
    hashes = block_hashes(TOKENS, 16)
    assert cached.tokens(TOKENS) == 0
    cached.seen([BlockStored(block_hashes=hashes[:2], parent_hash=None, block_size=16)])
    assert cached.tokens(TOKENS) == 32
    assert cached.tokens(TOKENS[:40]) == 32  # a shorter prompt: its own full blocks
    assert cached.tokens([7, *TOKENS[1:]]) == 0  # another first token: another chain
    cached.seen([BlockStored(block_hashes=hashes[2:], parent_hash=hashes[1], block_size=16)])
    assert cached.tokens(TOKENS) == 48  # never the tail: only whole blocks are named
    cached.seen([BlockRemoved(block_hashes=[hashes[1]])])
    assert cached.tokens(TOKENS) == 16  # a hole ends the run, as vLLM's lookup stops
    cached.seen([AllCleared()])
    assert cached.tokens(TOKENS) == 0


def test_the_hit_is_whole_vllm_blocks_where_they_are_larger() -> None:
    """Two chats sharing a system prompt of one router block (16) but not vLLM's whole
    block (32) around it: vLLM's cache hits nothing there, so neither may the answer."""
    cached = CachedPrefix(16, 32)
    hashes = block_hashes(TOKENS, 16)
    cached.seen([BlockStored(block_hashes=hashes[:1], parent_hash=None, block_size=16)])
    assert cached.tokens(TOKENS) == 0
    cached.seen([BlockStored(block_hashes=hashes[1:], parent_hash=hashes[0], block_size=16)])
    assert cached.tokens(TOKENS) == 32
