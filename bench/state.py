"""Router state at scale: Redis traffic per request, prefix index memory, and its bound.

    python bench/state.py [--redis redis://127.0.0.1:6412/15] [--requests 50]
                          [--memory-entries 100000,300000]
                          [--parts traffic,memory,bound,replicas,inflight]

Needs a redis-server of its own (``redis-server --port 6412 --save '' --appendonly no
--daemonize yes``): the bench FLUSHes the given database, and its traffic and memory
figures are server-wide deltas (``INFO commandstats``, ``INFO stats`` bytes, ``INFO
memory``), less the bench's own INFO calls (measured by an empty round).

1. Traffic: the calls the router makes per request, through the real store classes
   (``SharedStore``, ``PrefixIndex``, ``Lease``): the prefix lookup, the in-flight
   read, a lease on prefill and main decode, the MD handshake's ``confirm``; and,
   apart, the cache events the request makes P and MD publish (fed by the poll loop).
   Writes go to Redis behind the request; each request waits for them (``settled``)
   so they count against it.
2. Memory: bytes per (instance, block) entry of the in-process index (tracemalloc)
   and of Redis, at growing sizes (distinct hashes per instance, the worst case), so the
   per-entry cost can be seen to be linear and extrapolated to 1,000 instances x 1M.
3. Bound: entries held under endless traffic with the router's expiry sweep, on a
   fake clock over ten TTLs: they level off at rate x (TTL + sweep period).
4. Replicas: the ``replicas`` set after router pods came and went (each wrote its load
   once and stopped): it holds the live replicas once a reader has run.
5. The in-flight read at scale: other replicas each with requests on many instances,
   read for every decision (a budget of 0, what the router did before) and on the
   store's budget (``loads_refresh_s``), decisions at a given rate on a fake clock (the
   budget is in seconds: the figure per request depends on the rate, not on how fast
   this machine runs the loop).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis
import redis.asyncio

from pdd.common.cache_events import BlockStored
from pdd.router.lease import Lease
from pdd.router.prefix_index import InMemoryIndexStore, PrefixIndex, PrefixIndexConfig
from pdd.router.state.redis_store import RedisIndexStore, RedisLoads
from pdd.router.state.shared import LOADS_REFRESH_S, SharedStore

BLOCK = 16
#: The router's expiry sweep: every 60 polls of 0.5 s (registry._EXPIRE_EVERY, poll_interval_s).
SWEEP_S = 30.0


@dataclass
class Traffic:
    commands: float
    sent: float
    received: float


def redis_counters(r: redis.Redis) -> tuple[int, int, int]:
    """(commands, bytes in, bytes out) server-wide so far."""
    stats = r.info("commandstats")
    calls = sum(v["calls"] for k, v in stats.items() if k != "cmdstat_info")
    net = r.info("stats")
    return calls, net["total_net_input_bytes"], net["total_net_output_bytes"]


async def measure(r: redis.Redis, n: int, work: Callable[[int], Awaitable[None]]) -> Traffic:
    """Per-call Redis traffic of ``work(i)`` over n calls, less the INFO calls' own."""

    async def nothing() -> None:
        return None

    async def all_calls() -> None:
        for i in range(n):
            await work(i)

    async def delta(run: Callable[[], Awaitable[None]]) -> tuple[int, int, int]:
        before = redis_counters(r)
        await run()
        after = redis_counters(r)
        return tuple(a - b for a, b in zip(after, before, strict=True))  # type: ignore[return-value]

    empty = await delta(nothing)
    busy = await delta(all_calls)
    c, i, o = (b - e for b, e in zip(busy, empty, strict=True))
    # Bytes in: what clients sent Redis (the router's requests); out: Redis's replies.
    return Traffic(commands=c / n, sent=i / n, received=o / n)


def prompt(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(150_000) for _ in range(blocks * BLOCK)]


async def traffic(url: str, requests: int) -> None:
    # Traffic, not latency: a loaded machine must not send the reads to local state. The
    # in-flight read is made for every request here, whatever the loop's speed (part 5
    # measures it on the store's budget).
    store = SharedStore(url, "bench-replica", ttl_s=600.0, deadline_s=30.0, loads_refresh_s=0.0)
    await store.start()
    r = redis.Redis.from_url(url)
    index = PrefixIndex(PrefixIndexConfig(block_size=BLOCK), store.index, clock=time.time)
    print("| prompt tokens | cache | what | commands | bytes sent | bytes received |")
    print("|---:|---|---|---:|---:|---:|")
    for blocks in (64, 512):
        for hit in (False, True):
            prompts = [
                prompt(blocks * 10**6 + (0 if hit else 1 + i), blocks) for i in range(requests)
            ]
            hashes = [index.hashes(p) for p in prompts]
            if hit:  # the prompt is already on P and MD
                for h in hashes[:1]:
                    index.apply(
                        "p0", BlockStored(block_hashes=h, parent_hash=None, block_size=BLOCK)
                    )
                    index.apply(
                        "md0", BlockStored(block_hashes=h, parent_hash=None, block_size=BLOCK)
                    )
                await store.settled()  # the set-up's writes are not the request's

            async def request(i: int, hashes: list[list[int]] = hashes, hit: bool = hit) -> None:
                await index.match_via(store.holders, hashes[i])
                await store.inflight()
                lease = Lease(store)
                lease.acquire(["p0", "md0"])
                index.confirm("md0", hashes[i], len(hashes[i]) * BLOCK if hit else 0)
                lease.release_all()
                await store.settled()

            async def events(i: int, hashes: list[list[int]] = hashes) -> None:
                for instance in ("p0", "md0"):
                    index.apply(
                        instance,
                        BlockStored(block_hashes=hashes[i], parent_hash=None, block_size=BLOCK),
                    )
                await store.settled()

            cache = "hit" if hit else "miss"
            for what, work in (("request path", request), ("its cache events", events)):
                if hit and what != "request path":
                    continue  # a hit stores no new blocks
                t = await measure(r, requests, work)
                assert store.shared, "Redis went down during the measurement"
                print(
                    f"| {blocks * BLOCK} | {cache} | {what} | {t.commands:.0f} "
                    f"| {t.sent:,.0f} | {t.received:,.0f} |"
                )
    await store.close()


def fill(store: InMemoryIndexStore, instances: int, blocks: int) -> None:
    for i in range(instances):
        base = i * blocks
        store.add(f"md{i}", range(base, base + blocks), now=1000.0)


async def fill_redis(url: str, instances: int, blocks: int) -> None:
    client = redis.asyncio.Redis.from_url(url)
    store = RedisIndexStore(client, ttl_s=600.0)
    for i in range(instances):
        base = i * blocks
        await store.add(f"md{i}", range(base, base + blocks), now=1000.0)
    await client.aclose()


def memory(url: str, sizes: list[int], instances: int) -> None:
    r = redis.Redis.from_url(url)
    print(f"\n| entries ({instances} instances) | in-process bytes/entry | Redis bytes/entry |")
    print("|---:|---:|---:|")
    for entries in sizes:
        blocks = entries // instances
        tracemalloc.start()
        local = InMemoryIndexStore(ttl_s=600.0)
        fill(local, instances, blocks)
        in_process = tracemalloc.get_traced_memory()[0] / entries
        tracemalloc.stop()
        del local
        r.flushdb()
        before = r.info("memory")["used_memory"]
        asyncio.run(fill_redis(url, instances, blocks))
        in_redis = (r.info("memory")["used_memory"] - before) / entries
        r.flushdb()
        print(f"| {entries:,} | {in_process:.0f} | {in_redis:.0f} |")


def bound(ttl_s: float, rate: int, minutes: int) -> None:
    """Entries held under endless traffic of new blocks, on a fake clock (the store takes
    ``now`` as an argument: no waiting)."""
    index = InMemoryIndexStore(ttl_s)
    print(f"\n| minute (TTL {ttl_s:.0f} s, {rate} new blocks/s, sweep {SWEEP_S:.0f} s) | entries |")
    print("|---:|---:|")
    peak = 0
    for second in range(minutes * 60):
        index.add("md0", range(second * rate, (second + 1) * rate), now=float(second))
        if second % SWEEP_S == 0:  # the fullest moment is just before a sweep
            peak = max(peak, len(index.entries()))
            index.expire(float(second))
        if (second + 1) % (minutes * 6) == 0:
            print(f"| {(second + 1) / 60:.0f} | {len(index.entries()):,} |")
    print(f"bound rate x (TTL + sweep) = {rate * (ttl_s + SWEEP_S):,.0f}; peak seen {peak:,}")


async def replica_churn(url: str, pods: int) -> None:
    """``pods`` replicas each write their load once (1 s TTL) and go; one stays."""
    client = redis.asyncio.Redis.from_url(url)
    await RedisLoads(client, "stays", 600).add("md0", 1)
    for pod in range(pods):
        await RedisLoads(client, f"pod-{pod}", 1).add("md0", 1)
    reader = RedisLoads(client, "reader", 600)
    members_before = await client.scard("pdd:replicas")
    while await client.keys("pdd:load:pod-*"):  # Redis expires them (1 s TTL)
        await asyncio.sleep(0.1)
    left = await reader.others()
    members_after = await client.scard("pdd:replicas")
    await client.aclose()
    print(f"\nreplicas set: {members_before} members after {pods} pods came and went;")
    print(f"{members_after} after their load keys expired and one read (in flight: {left})")


async def inflight_reads(url: str, replicas: int, busy: int, rate: float, requests: int) -> None:
    """Redis traffic per decision of the in-flight read, with ``replicas`` other replicas
    each holding requests on ``busy`` instances, at ``rate`` decisions/s."""
    client = redis.asyncio.Redis.from_url(url)
    for k in range(replicas):
        await RedisLoads(client, f"other-{k}", 600).publish({f"md{i}": 1 for i in range(busy)})
    await client.aclose()
    r = redis.Redis.from_url(url)
    print(
        f"\n| in-flight read: {replicas} other replicas x {busy} busy instances, "
        f"{rate:g} decisions/s | commands | bytes sent | bytes received |"
    )
    print("|---|---:|---:|---:|")
    for refresh_s in (0.0, LOADS_REFRESH_S):
        t = await read_loads(url, r, refresh_s, rate, requests)
        what = "every decision (before)" if refresh_s == 0 else f"at most every {refresh_s:g} s"
        print(f"| {what} | {t.commands:.2f} | {t.sent:,.0f} | {t.received:,.0f} |")


async def read_loads(
    url: str, r: redis.Redis, refresh_s: float, rate: float, requests: int
) -> Traffic:
    """One replica's in-flight reads at ``rate`` decisions/s of a fake clock."""
    clock = [0.0]
    store = SharedStore(
        url, "bench-reader", ttl_s=600.0, heartbeat_s=600.0, deadline_s=30.0,
        loads_refresh_s=refresh_s, clock=lambda: clock[0],
    )  # fmt: skip
    await store.start()

    async def decide(i: int) -> None:
        clock[0] = i / rate
        await store.inflight()

    t = await measure(r, requests, decide)
    assert store.shared, "Redis went down during the measurement"
    await store.close()
    return t


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis", default="redis://127.0.0.1:6412/15")
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--memory-entries", default="100000,300000")
    parser.add_argument("--instances", type=int, default=1000)
    parser.add_argument("--parts", default="traffic,memory,bound,replicas,inflight")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    redis.Redis.from_url(args.redis).flushdb()
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1/5/15 min)\n")
    if "traffic" in parts:
        asyncio.run(traffic(args.redis, args.requests))
    if "memory" in parts:
        memory(args.redis, [int(n) for n in args.memory_entries.split(",")], args.instances)
    if "bound" in parts:
        bound(ttl_s=600.0, rate=100, minutes=60)
    if "replicas" in parts:
        asyncio.run(replica_churn(args.redis, pods=1000))
    if "inflight" in parts:
        redis.Redis.from_url(args.redis).flushdb()
        reads = inflight_reads(args.redis, 3, args.instances, rate=200, requests=400)
        asyncio.run(reads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
