"""BlockPool: reference counting, all-or-nothing allocation, errors that say what to do."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdd.worker.engine.block_pool import BlockPool, BlockRefcountError, OutOfBlocksError

pytestmark = pytest.mark.unit


def test_fresh_pool_hands_out_distinct_blocks_at_refcount_one() -> None:
    pool = BlockPool(8)
    blocks = pool.allocate(5)
    assert len(set(blocks)) == 5
    assert all(0 <= b < 8 for b in blocks)
    assert [pool.refcount(b) for b in blocks] == [1] * 5
    assert (pool.num_free, pool.num_used, pool.num_total) == (3, 5, 8)


def test_out_of_blocks_is_all_or_nothing_and_says_why() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(OutOfBlocksError) as err:
        pool.allocate(2)
    assert (err.value.requested, err.value.num_free, err.value.num_total) == (2, 1, 4)
    assert "requested 2 KV blocks but only 1 of 4 are free" in str(err.value)
    assert "evict" in str(err.value)
    assert pool.num_free == 1
    assert not pool.can_allocate(2)
    assert pool.can_allocate(1)
    pool.check_integrity()


def test_shared_block_returns_to_free_list_after_last_holder() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.incref([block])
    pool.free([block])
    assert pool.refcount(block) == 1
    assert pool.num_free == 1
    pool.free([block])
    assert pool.refcount(block) == 0
    assert pool.num_free == 2
    pool.check_integrity()


def test_double_free_raises_and_leaves_pool_untouched() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(BlockRefcountError, match=f"double free of block {a}"):
        pool.free([b, a])
    assert pool.refcount(b) == 1  # b was not freed by the failed call
    with pytest.raises(BlockRefcountError, match="double free"):
        pool.free([b, b])
    assert pool.refcount(b) == 1
    pool.check_integrity()


def test_incref_of_free_block_raises() -> None:
    pool = BlockPool(2)
    with pytest.raises(BlockRefcountError, match="incref of free block 0"):
        pool.incref([0])
    assert pool.num_free == 2


def test_block_ids_outside_pool_raise() -> None:
    pool = BlockPool(2)
    with pytest.raises(BlockRefcountError, match="outside this pool"):
        pool.free([2])
    with pytest.raises(BlockRefcountError, match="outside this pool"):
        pool.refcount(-1)


def test_bad_sizes_raise() -> None:
    with pytest.raises(ValueError, match="num_blocks must be positive"):
        BlockPool(0)
    with pytest.raises(ValueError, match="negative"):
        BlockPool(1).allocate(-1)
    assert BlockPool(1).allocate(0) == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "grow", "incref", "free"]), st.integers(0, 5))))
def test_random_alloc_incref_free_matches_a_count_model(ops: list[tuple[str, int]]) -> None:
    pool = BlockPool(10)
    held: list[int] = []  # one entry per reference the test holds
    for op, n in ops:
        if op in ("alloc", "grow"):
            after = held[-1] if op == "grow" and held else None
            if n > pool.num_free:
                with pytest.raises(OutOfBlocksError):
                    pool.allocate(n, after=after)
            else:
                new = pool.allocate(n, after=after)
                assert len(set(new)) == n and not set(new) & set(held)
                held += new
        elif op == "incref" and held:
            pool.incref(held[:n])
            held += held[:n]
        elif op == "free":
            pool.free(held[:n])
            del held[:n]
        pool.check_integrity()
        assert pool.num_used == len(set(held))
        assert all(pool.refcount(b) == held.count(b) for b in set(held))
    pool.free(held)
    assert pool.num_free == pool.num_total


def test_growing_sequences_stay_contiguous_runs() -> None:
    pool = BlockPool(64)
    tables = [pool.allocate(3) for _ in range(4)]
    for _ in range(5):  # interleaved growth, as decodes of a batch cross block boundaries
        for table in tables:
            table += pool.allocate(1, after=table[-1])
    for table in tables:
        assert table == list(range(table[0], table[0] + 8))
    pool.check_integrity()


def test_growth_past_a_used_block_falls_back_to_any_free_block() -> None:
    pool = BlockPool(4)
    first = pool.allocate(4)
    pool.free([first[0], first[2]])
    grown = pool.allocate(2, after=first[3])  # nothing free after the last block
    assert sorted(grown) == [first[0], first[2]]
    assert pool.num_free == 0
    pool.check_integrity()


def test_allocation_scatters_when_no_free_run_is_long_enough() -> None:
    pool = BlockPool(6)
    blocks = pool.allocate(6)
    pool.free(blocks[::2])
    assert sorted(pool.allocate(3)) == sorted(blocks[::2])
    pool.check_integrity()
