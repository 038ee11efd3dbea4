"""The Redis-backed stores, and the shared store's behaviour when Redis goes away or hangs."""

import asyncio
import os
import time
import uuid

import pytest
import redis
import redis.asyncio

from pdd.common.block_hash import block_hashes
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


async def test_redis_index_store_serves_the_prefix_index(redis_url):
    client = redis.asyncio.Redis.from_url(redis_url)
    store = RedisIndexStore(client, ttl_s=60, prefix=f"t-{uuid.uuid4().hex}:")
    index = PrefixIndex(PrefixIndexConfig(block_size=16, ttl_s=60), clock=lambda: now)
    now = 1000.0
    await store.add("a", HASHES, now)
    await store.add("b", HASHES[:2], now)
    assert await index.match_via(store.holders, HASHES) == {"a": 64, "b": 32}
    await store.remove("a", [HASHES[2]])
    assert await index.match_via(store.holders, HASHES) == {"a": 32, "b": 32}
    await store.clear("b")
    assert await index.match_via(store.holders, HASHES) == {"a": 32}
    now += 61
    assert await index.match_via(store.holders, HASHES) == {}
    assert await store.expire(now) == 3  # a's blocks 0, 1 and 3 were still stored
    assert await store.holders(HASHES, now) == [set()]
    await client.aclose()


async def test_redis_index_levels_off_under_endless_traffic(redis_url):
    """Ever-new blocks for ten TTLs with the router's sweep: Redis holds rate x (TTL +
    sweep) entries and as many block keys, not everything ever stored."""
    client = redis.asyncio.Redis.from_url(redis_url)
    prefix = f"t-{uuid.uuid4().hex}:"
    store = RedisIndexStore(client, ttl_s=20, prefix=prefix)
    rate, sweep_s = 5, 4
    for second in range(10 * 20):
        await store.add("md0", range(second * rate, (second + 1) * rate), 1000.0 + second)
        if second % sweep_s == 0:
            await store.expire(1000.0 + second)
    held = await client.zcard(f"{prefix}idx:i:md0")
    block_keys = len([k async for k in client.scan_iter(match=f"{prefix}idx:h:*")])
    assert rate * 20 <= held <= rate * (20 + sweep_s)
    assert block_keys == held
    await client.aclose()


async def test_loads_sum_over_the_other_replicas(redis_url):
    client = redis.asyncio.Redis.from_url(redis_url)
    prefix = f"t-{uuid.uuid4().hex}:"
    one, two = RedisLoads(client, "r1", 10, prefix), RedisLoads(client, "r2", 10, prefix)
    await one.add("md1", 1)
    await two.add("md1", 2)
    await two.add("p", 1)
    await two.add("p", -1)
    assert await one.others() == {"md1": 2}  # its own count it keeps in memory
    await one.publish({"md1": 5})
    assert await two.others() == {"md1": 5}
    await client.aclose()


async def test_other_replicas_counts_are_read_on_a_budget(own_redis):
    """A decision reads the other replicas' counts from Redis at most once per
    ``loads_refresh_s`` (a fake clock here); between reads it sums the counts read last
    with this replica's own."""
    now = 0.0
    prefix = f"t-{uuid.uuid4().hex}:"
    client = redis.asyncio.Redis.from_url(own_redis.url)
    other = RedisLoads(client, "r2", 10, prefix)
    await other.add("md1", 2)
    store = SharedStore(
        own_redis.url, "r1", ttl_s=600, prefix=prefix, deadline_s=30, loads_refresh_s=0.1,
        clock=lambda: now,
    )  # fmt: skip
    store.add_inflight("md1", 1)  # before start: kept locally, published by the start
    store.add_inflight("p0", 1)
    await store.start()
    try:
        assert await store.inflight() == {"md1": 3, "p0": 1}
        assert store.take_moved() == {"md1", "p0"}
        await other.add("md1", 5)
        now += 0.05
        assert await store.inflight() == {"md1": 3, "p0": 1}  # the others' as read last
        assert store.take_moved() == set()
        now += 0.05
        total = await store.inflight()
        assert total == {"md1": 8, "p0": 1} and total.get("md9", 0) == 0
        assert store.take_moved() == {"md1"}  # what the new read changed
    finally:
        await store.close()
        await client.aclose()


async def test_replicas_that_stop_refreshing_leave_the_set(redis_url):
    """Router pods come and go; the set of replicas holds the live ones only: each
    member's mark expires with its TTL, and any replica's next write drops it, whether
    or not a replica ever reads the set."""
    client = redis.asyncio.Redis.from_url(redis_url)
    inspect = redis.Redis.from_url(redis_url)
    prefix = f"t-{uuid.uuid4().hex}:"
    now = 1000.0

    def loads(replica: str, ttl_s: float) -> RedisLoads:
        return RedisLoads(client, replica, ttl_s, prefix, clock=lambda: now)

    live = loads("live", 600)
    await live.add("md1", 1)
    for pod in range(20):  # each writes once, with a 1 s TTL, and is never heard of again
        await loads(f"gone-{pod}", 1).add("md1", 1)
    reader = loads("reader", 600)
    assert await reader.others() == {"md1": 21}
    assert inspect.zcard(f"{prefix}replicas:seen") == 21
    now += 2  # the gone pods' marks expired; their load hashes expire in Redis
    assert await reader.others() == {"md1": 1}  # expired marks are not read
    await live.publish({"md1": 1})  # the live replica's heartbeat drops them
    assert inspect.zrange(f"{prefix}replicas:seen", 0, -1) == [b"live"]
    await until(
        lambda: not inspect.keys(f"{prefix}load:gone-*"), "the gone pods' load hashes expiring"
    )
    await client.aclose()


async def test_a_hundred_replica_restarts_leave_no_growing_key_set(redis_url):
    """Each restart is a new replica id (pod names, pids); a replica that stops leaves
    Redis at once, so the keys after 100 restarts are the keys after one."""
    inspect = redis.Redis.from_url(redis_url)
    prefix = f"t-{uuid.uuid4().hex}:"
    survivor = SharedStore(redis_url, "survivor", ttl_s=600, prefix=prefix, deadline_s=30)
    await survivor.start()
    survivor.add_inflight("md1", 1)
    await survivor.settled()
    counts = []
    try:
        for restart in range(100):
            replica = SharedStore(
                redis_url, f"router-{restart}", ttl_s=600, prefix=prefix, deadline_s=30
            )
            await replica.start()
            replica.add_inflight("md1", 1)  # a request in flight on it when it stops
            await replica.settled()
            replica.add_inflight("md1", -1)
            await replica.close()
            counts.append(len(inspect.keys(f"{prefix}*")))
        assert counts[-1] == counts[0], counts
        assert inspect.zrange(f"{prefix}replicas:seen", 0, -1) == [b"survivor"]
        assert not inspect.keys(f"{prefix}load:router-*")
    finally:
        await survivor.close()


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
        assert await store.holders(HASHES, time.time()) == [{"md1"}] * 4
        assert not store.shared and changes == [True, False]
        assert await store.inflight() == {"md1": 2}
        own_redis.start()  # a fresh, empty Redis on the same port
        await until(lambda: store.shared, "the store reconnecting to Redis")
        client = redis.asyncio.Redis.from_url(own_redis.url)
        fresh = RedisIndexStore(client, ttl_s=600)
        assert await fresh.holders(HASHES, time.time()) == [{"md1"}] * 4
        assert await RedisLoads(client, "r2", 10).others() == {"md1": 2}
        await client.aclose()
    finally:
        await store.close()


async def test_a_read_held_by_a_hung_redis_blocks_nothing_else(own_redis):
    """Redis stopped (SIGSTOP: connections accepted, nothing answered) and a deadline
    longer than the test: the read waits, and meanwhile the event loop goes on (the
    condition below is polled on it) and writes are taken without waiting. When Redis
    answers again the read gets Redis's answer."""
    store = SharedStore(own_redis.url, "r1", ttl_s=600, heartbeat_s=0.1, deadline_s=600)
    await store.start()
    try:
        store.index.add("md1", HASHES, time.time())
        client = redis.asyncio.Redis.from_url(own_redis.url)
        await RedisIndexStore(client, ttl_s=600).add("md2", HASHES, time.time())
        await client.aclose()  # another replica's write: in Redis only
        own_redis.pause()
        read = asyncio.create_task(store.holders(HASHES, time.time()))
        await until(lambda: store.reads_waiting == 1, "the read waiting on the hung Redis")
        store.add_inflight("md1", 1)  # returns at once: sent behind
        assert store.index.holders(HASHES, time.time()) == [{"md1"}] * 4
        assert not read.done()
        own_redis.resume()
        assert {"md2"} <= (await read)[0]  # Redis's answer, not the local store's
    finally:
        own_redis.resume()
        await store.close()


async def test_a_hung_redis_costs_one_deadline_then_local_state_until_it_answers(own_redis):
    changes: list[bool] = []
    store = SharedStore(
        own_redis.url, "r1", ttl_s=600, heartbeat_s=0.1, deadline_s=0.2, on_change=changes.append
    )
    await store.start()
    try:
        store.index.add("md1", HASHES[:2], time.time())
        own_redis.pause()
        store.index.add("md1", HASHES[2:], time.time())
        store.add_inflight("md1", 1)
        # The read gives up at the deadline and answers from local state; so do later
        # ones, without asking Redis, while it is down.
        assert await store.holders(HASHES, time.time()) == [{"md1"}] * 4
        assert not store.shared and changes == [True, False]
        assert await store.inflight() == {"md1": 1}
        assert store.reads_waiting == 0
        own_redis.resume()
        await until(lambda: store.shared, "the store re-seeding Redis once it answers")
        client = redis.asyncio.Redis.from_url(own_redis.url)
        assert await RedisIndexStore(client, 600).holders(HASHES, time.time()) == [{"md1"}] * 4
        assert await RedisLoads(client, "r2", 10).others() == {"md1": 1}
        await client.aclose()
    finally:
        own_redis.resume()
        await store.close()


async def test_a_black_holed_redis_never_delays_start_or_reads():
    """A host that accepts connections and never answers, from the start: the store
    starts down after one deadline, serves from local state, and keeps probing."""
    accepted: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # read nothing, answer nothing, keep it open

    hole = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = hole.sockets[0].getsockname()[1]
    changes: list[bool] = []
    store = SharedStore(
        f"redis://127.0.0.1:{port}/0", "r1", 600, heartbeat_s=0.05, deadline_s=0.2,
        on_change=changes.append,
    )  # fmt: skip
    try:
        await store.start()  # returns after the probe's deadline, Redis or not
        assert not store.shared and changes == []
        store.index.add("md1", HASHES, time.time())
        store.add_inflight("md1", 1)
        assert await store.holders(HASHES, time.time()) == [{"md1"}] * 4
        assert await store.inflight() == {"md1": 1}
        await until(lambda: len(accepted) >= 2, "the store probing the black hole again")
        assert not store.shared
    finally:
        await store.close()
        hole.close()
        for writer in accepted:
            writer.close()


async def test_close_returns_when_the_writers_cancel_lands_on_a_wake_up(redis_url):
    """A write wakes the idle writer and close() cancels it a few loop turns later. When
    the cancel lands after the wake-up completed but before the writer resumed, Python's
    ``wait_for`` returns the wake-up and drops the cancel; a writer that relied on the
    cancel alone ran on, and close() never returned. Each number of turns puts the cancel
    at another point of that hand-over."""
    for turns in range(8):
        prefix = f"t-{uuid.uuid4().hex}:"
        store = SharedStore(redis_url, f"r-{uuid.uuid4().hex}", ttl_s=60, prefix=prefix)
        await store.start()
        await until(lambda: store._wake._waiters, "the writer waits for work")  # noqa: B023
        store.add_inflight("md0", 1)
        for _ in range(turns):
            await asyncio.sleep(0)
        closing = asyncio.create_task(store.close())
        done, _ = await asyncio.wait({closing}, timeout=30)  # a hang's backstop, not a timing
        assert closing in done, f"close() did not return (cancel {turns} turns after a write)"
