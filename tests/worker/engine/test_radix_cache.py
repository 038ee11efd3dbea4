"""RadixCache against NaivePrefixCache: same random operations, same answers, no leaks.

The stateful test plays an engine: requests match and lock a prefix, allocate blocks
for the rest (evicting when the pool is short), insert the whole sequence, free their
own blocks and unlock; other steps match, lock, unlock, evict and reset at random.
Tokens are cuts of a few shared stems plus short random tails (block size 2), so
prefixes share deeply and nodes split constantly. The unit tests below pin the
contract on both implementations.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdd.common.block_hash import block_hashes
from pdd.common.cache_events import AllCleared, BlockRemoved, BlockStored, CacheEvent
from pdd.worker.engine.block_pool import BlockPool
from pdd.worker.engine.prefix_cache import (
    InvalidInsertError,
    LockError,
    NaivePrefixCache,
    PrefixCache,
    StaleHandleError,
)
from pdd.worker.engine.radix_cache import RadixCache

pytestmark = pytest.mark.unit

BS = 2
POOL_BLOCKS = 24
# A cut of one of a few shared stems plus a random tail: long shared prefixes, and
# divergence at every depth, so nodes split and locks nest under one another.
_STEMS = ([0, 1, 2, 0, 1, 1, 2, 2, 0, 0, 1, 2], [0, 1, 2, 0, 2, 2, 1, 0, 1, 1], [2, 1] * 6)
TOKENS = st.builds(
    lambda stem, cut, tail: stem[:cut] + tail,
    st.sampled_from(_STEMS),
    st.integers(0, 12),
    st.lists(st.integers(0, 2), max_size=4),
)
IMPLS = ("radix", "naive")


def _normalized(events: list[CacheEvent]) -> list[tuple]:
    """Events comparable across implementations: removal order within one evict is free."""
    out: list[tuple] = []
    for ev in events:
        if isinstance(ev, BlockStored):
            out.append(("stored", tuple(ev.block_hashes), ev.parent_hash))
        elif isinstance(ev, BlockRemoved):
            out.append(("removed", tuple(sorted(ev.block_hashes))))
        else:
            out.append(("cleared",))
    return out


class _Side:
    """One implementation with its own pool and a record of what each block holds."""

    def __init__(self, cache_cls: type[PrefixCache]) -> None:
        self.pool = BlockPool(POOL_BLOCKS)
        self.cache = cache_cls(self.pool, BS)
        self.contents: dict[int, tuple[int, ...]] = {}  # block -> the token prefix it ends

    def allocate_for(self, tokens: list[int], first_block: int) -> list[int] | None:
        """Blocks for ``tokens`` from block index ``first_block`` on, evicting if short."""
        need = -(-len(tokens) // BS) - first_block
        if need > self.pool.num_free:
            self.cache.evict(need - self.pool.num_free)
        if need > self.pool.num_free:
            return None
        blocks = self.pool.allocate(need)
        for i, block in enumerate(blocks, start=first_block):
            self.contents[block] = tuple(tokens[: (i + 1) * BS])
        return blocks

    def check_match(self, tokens: list[int]) -> tuple[int, object]:
        match = self.cache.match_prefix(tokens)
        assert len(match.blocks) * BS == match.num_tokens
        for i, block in enumerate(match.blocks):
            assert self.contents[block] == tuple(tokens[: (i + 1) * BS])
        return match.num_tokens, match


class RadixVersusNaive(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sides = {"radix": _Side(RadixCache), "naive": _Side(NaivePrefixCache)}
        self.locked: list[dict[str, object]] = []  # per lock: each side's handle
        self.live_hashes: set[int] = set()  # replayed from the radix side's events

    def _both(self, fn: Callable[[_Side], object]) -> object:
        results = {name: fn(side) for name, side in self.sides.items()}
        assert results["radix"] == results["naive"], results
        return results["radix"]

    @rule(tokens=TOKENS)
    def serve_request(self, tokens: list[int]) -> None:
        self._both(lambda side: self._serve(side, tokens))

    def _serve(self, side: _Side, tokens: list[int]) -> tuple[int, int] | None:
        num_cached, match = side.check_match(tokens)
        side.cache.lock(match.handle)
        own = side.allocate_for(tokens, len(match.blocks))
        if own is None:
            side.cache.unlock(match.handle)
            return None
        already = side.cache.insert(tokens, list(match.blocks) + own)
        side.pool.free(own)
        side.cache.unlock(match.handle)
        return num_cached, already

    @rule(tokens=TOKENS)
    def insert_with_fresh_blocks(self, tokens: list[int]) -> None:
        def insert(side: _Side) -> int | None:
            blocks = side.allocate_for(tokens, 0)
            if blocks is None:
                return None
            already = side.cache.insert(tokens, blocks)
            side.pool.free(blocks)  # duplicates of cached blocks go back to the pool here
            return already

        self._both(insert)

    @rule(tokens=TOKENS)
    def match(self, tokens: list[int]) -> None:
        self._both(lambda s: s.check_match(tokens)[0])

    @rule(tokens=TOKENS)
    def match_and_lock(self, tokens: list[int]) -> None:
        handles = {}
        for name, side in self.sides.items():
            handles[name] = side.check_match(tokens)[1].handle
            side.cache.lock(handles[name])
        self.locked.append(handles)

    @precondition(lambda self: self.locked)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        handles = self.locked.pop(data.draw(st.integers(0, len(self.locked) - 1)))
        for name, side in self.sides.items():
            side.cache.unlock(handles[name])

    @rule(n=st.integers(0, 10))
    def evict(self, n: int) -> None:
        self._both(lambda s: s.cache.evict(n))

    @precondition(lambda self: not self.locked)
    @rule()
    def reset(self) -> None:
        self._both(lambda s: s.cache.reset())

    @invariant()
    def same_state_and_consistent(self) -> None:
        for side in self.sides.values():
            side.cache.check_integrity()
            side.pool.check_integrity()
        self._both(lambda s: (s.cache.evictable_blocks, s.cache.protected_blocks))
        self._both(lambda s: s.pool.num_free)
        events = self._both(lambda s: _normalized(s.cache.drain_events()))
        self._replay(events)  # type: ignore[arg-type]
        assert len(self.live_hashes) == self.sides["radix"].cache.num_cached_blocks

    def _replay(self, events: list[tuple]) -> None:
        for ev in events:
            if ev[0] == "stored":
                assert not self.live_hashes & set(ev[1])
                self.live_hashes |= set(ev[1])
            elif ev[0] == "removed":
                assert set(ev[1]) <= self.live_hashes
                self.live_hashes -= set(ev[1])
            else:
                self.live_hashes.clear()

    def teardown(self) -> None:
        for handles in self.locked:
            for name, side in self.sides.items():
                side.cache.unlock(handles[name])
        for side in self.sides.values():
            cached = side.cache.num_cached_blocks
            assert side.cache.evict(cached + 1) == cached
            assert side.cache.num_cached_blocks == 0
            side.cache.check_integrity()
            assert side.pool.num_free == POOL_BLOCKS  # no block leaked
            assert all(side.pool.refcount(b) == 0 for b in range(POOL_BLOCKS))
        self.same_state_and_consistent()
        assert not self.live_hashes


TestRadixVersusNaive = RadixVersusNaive.TestCase
TestRadixVersusNaive.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


# Contract tests, run on both implementations.


@pytest.fixture(params=IMPLS)
def cache(request: pytest.FixtureRequest) -> PrefixCache:
    cls = RadixCache if request.param == "radix" else NaivePrefixCache
    return cls(BlockPool(16), BS)


def _put(cache: PrefixCache, tokens: list[int]) -> tuple[int, list[int]]:
    """Insert ``tokens`` with fresh blocks as a finished request would; free its refs."""
    blocks = cache.pool.allocate(-(-len(tokens) // BS))
    already = cache.insert(tokens, blocks)
    cache.pool.free(blocks)
    return already, blocks


def test_insert_caches_full_blocks_only_and_reports_what_was_cached(cache: PrefixCache) -> None:
    assert _put(cache, [1, 2, 3, 4, 5]) == (0, [0, 1, 2])
    assert cache.num_cached_blocks == 2  # the partial tail [5] is not cached
    assert cache.pool.refcount(2) == 0
    match = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert (match.num_tokens, match.blocks) == (4, (0, 1))
    already, dup = _put(cache, [1, 2, 3, 4, 7, 8])
    assert already == 4
    assert [cache.pool.refcount(b) for b in dup] == [0, 0, 1]  # only the new block adopted
    assert cache.match_prefix([1, 2, 3, 4, 7, 8]).blocks == (0, 1, dup[2])
    cache.check_integrity()


def test_match_on_a_partial_node_returns_and_locks_only_the_match(cache: PrefixCache) -> None:
    _put(cache, [1, 1, 2, 2, 3, 3, 4, 4])
    match = cache.match_prefix([1, 1, 2, 2, 9, 9])
    assert (match.num_tokens, match.blocks) == (4, (0, 1))
    cache.lock(match.handle)  # a radix node of 4 blocks must split for this to be exact
    assert (cache.protected_blocks, cache.evictable_blocks) == (2, 2)
    assert cache.match_prefix([1, 1, 2, 2, 3, 3, 4, 4]).blocks == (0, 1, 2, 3)
    cache.check_integrity()
    assert cache.evict(10) == 2
    cache.unlock(match.handle)
    cache.check_integrity()


def test_lock_protects_the_prefix_and_its_ancestors(cache: PrefixCache) -> None:
    _put(cache, [1, 1, 2, 2, 3, 3])
    _put(cache, [1, 1, 2, 2, 5, 5, 6, 6])
    match = cache.match_prefix([1, 1, 2, 2, 3, 3])
    cache.lock(match.handle)
    assert (cache.protected_blocks, cache.evictable_blocks) == (3, 2)
    assert cache.evict(100) == 2  # only the unlocked branch [5 5][6 6] goes
    assert cache.match_prefix([1, 1, 2, 2, 5, 5]).num_tokens == 4
    cache.unlock(match.handle)
    assert (cache.protected_blocks, cache.evictable_blocks) == (0, 3)
    cache.check_integrity()


def test_eviction_follows_lru_and_match_refreshes(cache: PrefixCache) -> None:
    for first in (1, 2, 3):
        _put(cache, [first] * 4)
    cache.match_prefix([1] * 4)  # 1 is now the most recent; 2 the least
    assert cache.evict(2) == 2
    assert [cache.match_prefix([t] * 4).num_tokens for t in (2, 3, 1)] == [0, 4, 4]
    assert cache.evict(1) == 1  # the tail block of 3, touched before 1
    assert [cache.match_prefix([t] * 4).num_tokens for t in (3, 1)] == [2, 4]


def test_evict_takes_leaf_tails_then_parents_that_become_leaves(cache: PrefixCache) -> None:
    _put(cache, [1, 1, 2, 2, 3, 3, 4, 4])
    cache.match_prefix([1, 1, 2, 2, 9, 9])  # splits a radix node into [1 1][2 2] + [3 3][4 4]
    assert cache.evict(1) == 1  # exactly one block, from the tail
    assert cache.match_prefix([1, 1, 2, 2, 3, 3, 4, 4]).num_tokens == 6
    assert cache.evict(3) == 3  # the rest of the leaf, then its parent, now a leaf
    assert cache.num_cached_blocks == 0
    assert cache.pool.num_free == cache.pool.num_total
    assert cache.evict(1) == 0


def test_stale_handle_and_unbalanced_unlock_raise(cache: PrefixCache) -> None:
    _put(cache, [1, 1, 2, 2])
    match = cache.match_prefix([1, 1, 2, 2])
    with pytest.raises(LockError, match="not locked"):
        cache.unlock(match.handle)
    cache.evict(1)
    with pytest.raises(StaleHandleError, match="match again"):
        cache.lock(match.handle)
    empty = cache.match_prefix([7, 7])
    cache.lock(empty.handle)  # an empty match locks nothing and is never stale
    cache.unlock(empty.handle)
    cache.check_integrity()


def test_reset_needs_no_locks_and_frees_everything(cache: PrefixCache) -> None:
    _put(cache, [1, 1, 2, 2])
    match = cache.match_prefix([1, 1])
    cache.lock(match.handle)
    with pytest.raises(LockError, match="unlock first"):
        cache.reset()
    cache.unlock(match.handle)
    cache.reset()
    assert cache.num_cached_blocks == 0
    assert cache.pool.num_free == cache.pool.num_total
    assert isinstance(cache.drain_events()[-1], AllCleared)
    with pytest.raises(StaleHandleError):
        cache.lock(match.handle)
    cache.check_integrity()


def test_invalid_inserts_change_nothing(cache: PrefixCache) -> None:
    _put(cache, [1, 1, 2, 2])
    blocks = cache.pool.allocate(2)
    with pytest.raises(InvalidInsertError, match="got only 1 block ids"):
        cache.insert([3, 3, 4, 4], blocks[:1])
    with pytest.raises(InvalidInsertError, match="cached twice"):
        cache.insert([3, 3, 4, 4], [blocks[0], blocks[0]])
    with pytest.raises(InvalidInsertError, match=r"blocks \[1\] would be cached twice"):
        cache.insert([1, 1, 3, 3], [blocks[0], 1])
    assert cache.num_cached_blocks == 2
    assert [cache.pool.refcount(b) for b in blocks] == [1, 1]
    cache.check_integrity()


def test_radix_eviction_heap_stays_bounded_under_repeated_touches() -> None:
    cache = RadixCache(BlockPool(8), BS)
    _put(cache, [1, 1, 2, 2])
    for _ in range(500):
        cache.match_prefix([1, 1, 2, 2])  # each touch pushes a fresh heap entry
    assert len(cache._heap) <= 2 * cache._num_nodes + 65  # stale entries get compacted
    cache.check_integrity()
    assert cache.evict(2) == 2


def test_hashes_chain_across_inserts() -> None:
    cache = RadixCache(BlockPool(8), BS)
    _put(cache, [1, 1, 2, 2, 3, 3])
    _put(cache, [1, 1, 4, 4])
    first, second = cache.drain_events()
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.block_hashes == block_hashes([1, 1, 2, 2, 3, 3], BS)
    assert second.parent_hash == first.block_hashes[0]
    assert second.block_hashes == block_hashes([1, 1, 4, 4], BS)[1:]
