"""Prefix caches: leaf-first LRU, the capacity, and the holder index the router reads."""

from __future__ import annotations

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
