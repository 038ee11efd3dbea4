"""The Redis-backed index store, and the shared store's behaviour when Redis goes away."""

import os
import time
import uuid

import pytest
import redis

from pdd.common.block_hash import block_hashes
from pdd.common.cache_events import AllCleared, BlockRemoved, BlockStored
from pdd.router.prefix_index import PrefixIndex, PrefixIndexConfig
from pdd.router.state.redis_store import RedisIndexStore, RedisLoads
from pdd.router.state.shared import SharedStore
from pdd.testing.waiting import until

pytestmark = pytest.mark.integration

TOKENS = list(range(64))
HASHES = block_hashes(TOKENS, 16)


@pytest.fixture
def redis_url():
    url = os.environ.get("PDD_TEST_REDIS_URL")
    if not url:
        pytest.skip("PDD_TEST_REDIS_URL is unset (scripts/test.sh starts redis-server and sets it)")
    return url


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_redis_index_store_serves_the_prefix_index(redis_url):
    client = redis.Redis.from_url(redis_url)
    clock = Clock()
    store = RedisIndexStore(client, ttl_s=60, prefix=f"t-{uuid.uuid4().hex}:")
    index = PrefixIndex(PrefixIndexConfig(block_size=16, ttl_s=60), store, clock)
    index.apply("a", BlockStored(block_hashes=HASHES, parent_hash=None, block_size=16))
    index.apply("b", BlockStored(block_hashes=HASHES[:2], parent_hash=None, block_size=16))
    assert index.match(HASHES) == {"a": 64, "b": 32}
    index.apply("a", BlockRemoved(block_hashes=[HASHES[2]]))
    assert index.match(HASHES) == {"a": 32, "b": 32}
    index.apply("b", AllCleared())
    assert index.match(HASHES) == {"a": 32}
    clock.now += 61
    assert index.match(HASHES) == {}
    assert index.expire() == 3  # a's blocks 0, 1 and 3 were still stored
    assert store.holders(HASHES, clock.now) == [set()]


def test_redis_index_levels_off_under_endless_traffic(redis_url):
    """Ever-new blocks for ten TTLs with the router's sweep: Redis holds rate x (TTL +
    sweep) entries and as many block keys, not everything ever stored."""
    client = redis.Redis.from_url(redis_url)
    clock = Clock()
    prefix = f"t-{uuid.uuid4().hex}:"
    store = RedisIndexStore(client, ttl_s=20, prefix=prefix)
    index = PrefixIndex(PrefixIndexConfig(block_size=16, ttl_s=20), store, clock)
    rate, sweep_s = 5, 4
    for second in range(10 * 20):
        stored = range(second * rate, (second + 1) * rate)
        index.apply("md0", BlockStored(block_hashes=list(stored), parent_hash=None, block_size=16))
        if second % sweep_s == 0:
            index.expire()
        clock.now += 1
    held = client.zcard(f"{prefix}idx:i:md0")
    block_keys = sum(1 for _ in client.scan_iter(match=f"{prefix}idx:h:*"))
    assert rate * 20 <= held <= rate * (20 + sweep_s)
    assert block_keys == held


def test_loads_sum_over_replicas(redis_url):
    client = redis.Redis.from_url(redis_url)
    prefix = f"t-{uuid.uuid4().hex}:"
    one, two = RedisLoads(client, "r1", 10, prefix), RedisLoads(client, "r2", 10, prefix)
    one.add("md1", 1)
    two.add("md1", 2)
    two.add("p", 1)
    two.add("p", -1)
    assert one.total() == {"md1": 3}
    one.publish({"md1": 5})
    assert two.total() == {"md1": 7}


async def test_shared_store_keeps_serving_without_redis_and_reseeds_it(own_redis):
    changes: list[bool] = []
    store = SharedStore(own_redis.url, "r1", ttl_s=600, heartbeat_s=0.1, on_change=changes.append)
    await store.start()
    try:
        assert store.shared
        store.index.add("md1", HASHES[:2], time.time())
        store.add_inflight("md1", 1)
        own_redis.kill()
        # Writes and reads go on, from local state, and the outage is noticed.
        store.index.add("md1", HASHES[2:], time.time())
        store.add_inflight("md1", 1)
        assert not store.shared and changes == [True, False]
        assert [h for h in store.index.holders(HASHES, time.time())] == [{"md1"}] * 4
        assert store.inflight() == {"md1": 2}
        own_redis.start()  # a fresh, empty Redis on the same port
        await until(lambda: store.shared, "the store reconnecting to Redis")
        fresh = RedisIndexStore(redis.Redis.from_url(own_redis.url), ttl_s=600)
        assert fresh.holders(HASHES, time.time()) == [{"md1"}] * 4
        assert RedisLoads(redis.Redis.from_url(own_redis.url), "r2", 10).total() == {"md1": 2}
    finally:
        await store.close()
