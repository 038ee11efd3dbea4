"""The prefix index: worker cache events in, per-instance prefix hits out."""

import pytest

from pdd.common.block_hash import block_hashes
from pdd.common.cache_events import CACHE_EVENT_LIST_ADAPTER, AllCleared, BlockRemoved, BlockStored
from pdd.router.prefix_index import (
    BlockSizeMismatchError,
    InMemoryIndexStore,
    PrefixIndex,
    PrefixIndexConfig,
)

pytestmark = pytest.mark.unit

BS = 4
PROMPT = list(range(30))  # 7 full blocks, a 2-token tail
HASHES = block_hashes(PROMPT, BS)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def index(clock):
    return PrefixIndex(PrefixIndexConfig(block_size=BS, ttl_s=60), clock=clock)


def stored(hashes, parent=None):
    return BlockStored(block_hashes=list(hashes), parent_hash=parent, block_size=BS)


def test_hashes_match_worker_block_hashes(index):
    assert index.hashes(PROMPT) == HASHES
    assert len(HASHES) == 7


def test_events_in_hits_out(index):
    index.apply("md0", stored(HASHES[:3]))
    index.apply("md0", stored(HASHES[3:5], parent=HASHES[2]))
    index.apply("p0", stored(HASHES[:2]))
    assert index.match(HASHES) == {"md0": 5 * BS, "p0": 2 * BS}


def test_events_from_the_wire(index):
    """The worker's JSON event list parses and folds in."""
    payload = (
        f'[{{"type":"block_stored","block_hashes":{HASHES[:4]},"parent_hash":null,"block_size":4}},'
        f'{{"type":"block_removed","block_hashes":[{HASHES[3]}]}}]'
    )
    index.apply_all("md0", CACHE_EVENT_LIST_ADAPTER.validate_json(payload))
    assert index.match(HASHES) == {"md0": 3 * BS}


def test_other_prompts_do_not_hit(index):
    index.apply("md0", stored(HASHES))
    other = block_hashes([99, *PROMPT[1:]], BS)
    assert index.match(other) == {}


def test_diverging_suffix_hits_only_the_shared_prefix(index):
    index.apply("md0", stored(HASHES))
    forked = block_hashes([*PROMPT[:12], 7, 7, 7, 7, 7, 7, 7, 7], BS)
    assert index.match(forked) == {"md0": 3 * BS}


def test_eviction_removes_and_breaks_the_chain(index):
    index.apply("md0", stored(HASHES))
    index.apply("md0", BlockRemoved(block_hashes=[HASHES[6], HASHES[5]]))
    assert index.match(HASHES) == {"md0": 5 * BS}
    # A missed eviction upstream: the middle block is gone, later ones cannot count.
    index.apply("md0", BlockRemoved(block_hashes=[HASHES[2]]))
    assert index.match(HASHES) == {"md0": 2 * BS}


def test_all_cleared_forgets_only_that_instance(index):
    index.apply("md0", stored(HASHES))
    index.apply("md1", stored(HASHES[:2]))
    index.apply("md0", AllCleared())
    assert index.match(HASHES) == {"md1": 2 * BS}


def test_entries_expire_after_ttl(index, clock):
    index.apply("md0", stored(HASHES[:2]))
    clock.now += 30
    index.apply("md0", stored(HASHES[2:4], parent=HASHES[1]))
    clock.now += 31  # the first two blocks are 61 s old, the next two 31 s
    assert index.match(HASHES) == {}  # the chain starts with an expired block
    index.apply("md0", stored(HASHES[:2]))  # stored again: refreshed
    assert index.match(HASHES) == {"md0": 4 * BS}
    clock.now += 30
    assert index.match(HASHES) == {"md0": 2 * BS}


def test_expire_sweeps_only_old_entries(index, clock):
    index.apply("md0", stored(HASHES[:3]))
    clock.now += 50
    index.apply("md1", stored(HASHES[:1]))
    clock.now += 11
    assert index.expire() == 3
    assert index.expire() == 0
    assert index.match(HASHES) == {"md1": BS}


def test_missing_stored_event_is_tolerated(index):
    """Blocks 0-1 and 3-4 arrive, block 2's event was lost: the hit stops at block 2."""
    index.apply("md0", stored(HASHES[:2]))
    index.apply("md0", stored(HASHES[3:5], parent=HASHES[2]))
    assert index.match(HASHES) == {"md0": 2 * BS}


def test_missing_removed_event_is_corrected_by_confirm(index):
    """The index thinks md0 holds everything; the handshake says 2 blocks."""
    index.apply("md0", stored(HASHES))
    index.confirm("md0", HASHES, held_tokens=2 * BS + 3)
    assert index.match(HASHES) == {"md0": 2 * BS}


def test_confirm_refreshes_and_adds(index, clock):
    index.confirm("md0", HASHES, held_tokens=3 * BS)
    clock.now += 59
    index.confirm("md0", HASHES, held_tokens=3 * BS)
    clock.now += 59
    assert index.match(HASHES) == {"md0": 3 * BS}


def test_block_size_mismatch_is_refused(index):
    bad = BlockStored(block_hashes=[1], parent_hash=None, block_size=16)
    with pytest.raises(BlockSizeMismatchError, match="same block size"):
        index.apply("md0", bad)


def test_forget_instance(index):
    index.apply("md0", stored(HASHES))
    index.forget_instance("md0")
    index.forget_instance("never-seen")
    assert index.match(HASHES) == {}


def test_store_contract_holders_never_mutates():
    store = InMemoryIndexStore(ttl_s=10)
    store.add("a", [1, 2], now=0)
    assert store.holders([1, 2, 3], now=5) == [{"a"}, {"a"}, set()]
    assert store.holders([1, 2], now=10) == [set()]  # expired at exactly ttl
    assert store.holders([1, 2], now=5) == [{"a"}, {"a"}]
    store.remove("b", [1])  # unknown instance: ignored
    store.remove("a", [9])  # unknown hash: ignored
    assert store.expire(now=100) == 2


def test_endless_traffic_levels_off_at_rate_times_ttl(clock):
    """Ever-new blocks stored every second for twenty TTLs, swept as the router's poll
    loop does: the entries held stop growing at rate x (TTL + sweep period)."""
    store = InMemoryIndexStore(ttl_s=60)
    index = PrefixIndex(PrefixIndexConfig(block_size=BS, ttl_s=60), store, clock)
    rate, sweep_s = 10, 5
    for second in range(20 * 60):
        index.apply("md0", stored(range(second * rate, (second + 1) * rate)))
        if second % sweep_s == 0:
            index.expire()
        assert len(store.entries()) <= rate * (60 + sweep_s)
        clock.now += 1
    assert len(store.entries()) >= rate * 60  # still indexing the last TTL's blocks
