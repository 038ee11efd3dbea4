"""Cache events: the hashes a router indexes equal pdd.common.block_hash of the tokens."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pdd.common.block_hash import block_hashes
from pdd.common.cache_events import (
    CACHE_EVENT_LIST_ADAPTER,
    AllCleared,
    BlockRemoved,
    BlockStored,
    EventBuffer,
)
from pdd.worker.engine.block_pool import BlockPool
from pdd.worker.engine.prefix_cache import NaivePrefixCache, PrefixCache
from pdd.worker.engine.radix_cache import RadixCache

pytestmark = pytest.mark.unit

BS = 4


@pytest.fixture(params=["radix", "naive"])
def cache(request: pytest.FixtureRequest) -> PrefixCache:
    cls = RadixCache if request.param == "radix" else NaivePrefixCache
    return cls(BlockPool(16), BS, events_with_tokens=True)


def _insert(cache: PrefixCache, tokens: list[int]) -> None:
    blocks = cache.pool.allocate(-(-len(tokens) // BS))
    cache.insert(tokens, blocks)
    cache.pool.free(blocks)


def test_stored_events_carry_the_shared_chained_hashes(cache: PrefixCache) -> None:
    first = list(range(10))  # two full blocks and a tail
    second = [*first[:8], 50, 51, 52, 53, 54]  # shares two blocks, adds one
    _insert(cache, first)
    _insert(cache, second)
    _insert(cache, first)  # nothing new: no event
    stored = cache.drain_events()
    assert stored == [
        BlockStored(
            block_hashes=block_hashes(first, BS),
            parent_hash=None,
            block_size=BS,
            token_ids=first[:8],
        ),
        BlockStored(
            block_hashes=block_hashes(second, BS)[2:],
            parent_hash=block_hashes(first, BS)[1],
            block_size=BS,
            token_ids=[50, 51, 52, 53],
        ),
    ]
    assert stored[0].num_tokens == 8
    assert cache.drain_events() == []


def test_removed_and_cleared_events_name_the_dropped_blocks(cache: PrefixCache) -> None:
    tokens = list(range(12))
    _insert(cache, tokens)
    cache.drain_events()
    assert cache.evict(1) == 1
    [removed] = cache.drain_events()
    assert removed == BlockRemoved(block_hashes=block_hashes(tokens, BS)[2:])
    cache.reset()
    assert cache.drain_events() == [AllCleared()]


def test_tokens_are_left_out_unless_asked_for() -> None:
    cache = RadixCache(BlockPool(4), BS)
    _insert(cache, list(range(4)))
    [event] = cache.drain_events()
    assert isinstance(event, BlockStored)
    assert event.token_ids is None


def test_events_round_trip_through_json_by_type() -> None:
    events = [
        BlockStored(block_hashes=[1, 2**64 - 1], parent_hash=None, block_size=16),
        BlockRemoved(block_hashes=[2**64 - 1]),
        AllCleared(),
    ]
    wire = CACHE_EVENT_LIST_ADAPTER.dump_json(events)
    assert CACHE_EVENT_LIST_ADAPTER.validate_json(wire) == events


def test_malformed_events_are_rejected() -> None:
    with pytest.raises(ValidationError):
        CACHE_EVENT_LIST_ADAPTER.validate_python([{"type": "block_moved"}])
    with pytest.raises(ValidationError):
        BlockRemoved(block_hashes=[])
    with pytest.raises(ValidationError):
        BlockStored(block_hashes=[1], parent_hash=None, block_size=0)


def test_full_buffer_drops_oldest_and_counts() -> None:
    buffer = EventBuffer(capacity=2)
    for h in (1, 2, 3):
        buffer.append(BlockRemoved(block_hashes=[h]))
    assert buffer.num_dropped == 1
    assert [e.block_hashes for e in buffer.drain()] == [[2], [3]]  # type: ignore[union-attr]
    assert len(buffer) == 0
    with pytest.raises(ValueError, match="capacity must be positive"):
        EventBuffer(0)


def test_cache_reports_dropped_events() -> None:
    cache = RadixCache(BlockPool(8), BS, event_capacity=1)
    _insert(cache, list(range(4)))
    _insert(cache, list(range(100, 104)))
    assert cache.num_dropped_events == 1
    [kept] = cache.drain_events()
    assert kept.block_hashes == block_hashes(list(range(100, 104)), BS)  # type: ignore[union-attr]
