"""Prefix caches: leaf-first LRU, the capacity, and the holder index the router reads."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdd.simulator.prefix_cache import HolderIndex, PrefixCache

pytestmark = pytest.mark.unit


def chain(*labels: int) -> tuple[int, ...]:
    """Prefix-chained keys: a key names its whole prefix, like a block hash."""
    return tuple(hash(labels[: i + 1]) for i in range(len(labels)))


def test_match_counts_leading_blocks_only() -> None:
    index = HolderIndex(block_size=16)
    cache = PrefixCache("p0", 1000, 16, index)
    cache.insert(chain(1, 2, 3))
    assert cache.match(chain(1, 2, 3, 4)) == 3
    assert cache.match(chain(1, 9, 3)) == 1
    assert cache.match(chain(7)) == 0
    assert index.hits(chain(1, 2, 3, 4), input_tokens=70) == {"p0": 48}
    assert index.hits(chain(1, 2, 3), input_tokens=40) == {"p0": 40}  # capped at the prompt


def test_eviction_takes_the_least_recent_leaf_and_keeps_shared_prefixes() -> None:
    index = HolderIndex(block_size=1)
    cache = PrefixCache("p0", 4, 1, index)
    cache.insert(chain(1, 2, 3))  # a conversation
    cache.insert(chain(1, 2, 8))  # a sibling branch: touches 1, 2 again
    cache.insert(chain(1, 5))  # over capacity by one: the oldest leaf (1,2,3) goes
    assert cache.match(chain(1, 2, 3)) == 2
    assert cache.match(chain(1, 2, 8)) == 3
    assert cache.match(chain(1, 5)) == 2
    assert cache.evicted_blocks == 1
    assert index.hits(chain(1, 2, 3), 3) == {"p0": 2}


def test_index_reports_every_holder_at_its_own_depth() -> None:
    index = HolderIndex(block_size=10)
    a, b = PrefixCache("a", 100, 10, index), PrefixCache("b", 100, 10, index)
    a.insert(chain(1, 2, 3))
    b.insert(chain(1, 2))
    assert index.hits(chain(1, 2, 3), 30) == {"a": 30, "b": 20}


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), max_size=40),
    capacity=st.integers(1, 12),
)
def test_cache_stays_prefix_closed_bounded_and_indexed(prompts, capacity) -> None:
    """Whatever the inserts: never over capacity, every held key's parent is held (a
    radix tree evicts leaves only), and the index agrees with the cache exactly."""
    index = HolderIndex(block_size=1)
    cache = PrefixCache("p0", capacity, 1, index)
    parents: dict[int, int | None] = {}
    for labels in prompts:
        keys = chain(*labels)
        for i, key in enumerate(keys):
            parents[key] = keys[i - 1] if i else None
        cache.insert(keys)
        held = set(cache.keys())
        assert len(held) <= capacity
        assert all(parents[k] is None or parents[k] in held for k in held)
        assert {k for k in parents if index.hits((k,), 1)} == held
    for labels in prompts:
        keys = chain(*labels)
        expected = cache.match(keys)
        assert index.hits(keys, len(keys)).get("p0", 0) == expected


class _OrderedLru:
    """The model the cache must equal: an ``OrderedDict`` touched deepest-first on every
    insert, least recent evicted first (the representation the cache had before)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.evicted: list[int] = []

    def insert(self, keys: tuple[int, ...]) -> None:
        keep = keys[: self.capacity]
        for key in reversed(keep):
            self.lru[key] = None
            self.lru.move_to_end(key)
        while len(self.lru) > self.capacity:
            self.evicted.append(self.lru.popitem(last=False)[0])


@settings(max_examples=120, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=8), max_size=80),
    capacity=st.integers(1, 16),
)
def test_eviction_order_equals_an_ordered_dict_lru(prompts, capacity) -> None:
    """Stamps and touches (and their compaction) evict exactly what the plain LRU does,
    in the same order, and the index's answers follow."""
    index = HolderIndex(block_size=1)
    cache, model = PrefixCache("p0", capacity, 1, index), _OrderedLru(capacity)
    evicted: list[int] = []
    remove = index.remove
    index.remove = lambda bit, keys: (evicted.extend(keys), remove(bit, keys))  # type: ignore[method-assign]
    for n, labels in enumerate(prompts):
        keys = chain(*labels)
        cache.insert(keys)
        model.insert(keys)
        if n % 3 == 2:  # compaction (which a long run triggers) must keep the order too
            cache._compact()
        assert evicted == model.evicted
        assert set(cache.keys()) == set(model.lru)


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), max_size=30),
    capacities=st.lists(st.integers(1, 10), min_size=2, max_size=4),
)
def test_hits_equal_each_cache_match_across_instances(prompts, capacities) -> None:
    """Several caches over one index: every instance's hit depth is its own match (the
    binary search over holder masks relies on every cache being prefix-closed)."""
    index = HolderIndex(block_size=1)
    caches = [PrefixCache(f"i{n}", cap, 1, index) for n, cap in enumerate(capacities)]
    for n, labels in enumerate(prompts):
        caches[n % len(caches)].insert(chain(*labels))
    for labels in prompts:
        keys = chain(*labels)
        expected = {c.instance_id: c.match(keys) for c in caches if c.match(keys)}
        assert index.hits(keys, len(keys)) == expected
