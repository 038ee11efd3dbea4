"""Prefix index entries and in-flight counts in Redis, shared by router replicas.

Layout (every key under ``prefix``, default ``pdd:``):

* ``idx:h:<hash>``: HASH instance -> last seen; the per-block lookup.
* ``idx:i:<instance>``: ZSET hash scored by last seen; for clear and expiry.
* ``load:<replica>``: HASH instance -> requests that replica has in flight; it
  expires unless the replica refreshes it, so a dead replica's load fades out.
* ``replicas``: SET of replica ids with a load hash. A reader that finds a member's
  hash gone (expired: the replica stopped refreshing it) removes the member, so the
  set holds the live replicas, not every replica that ever ran.

Index keys also carry a Redis TTL, so entries of instances nobody expires any more
cannot pile up. The client is ``redis.asyncio``: every call here is a coroutine and
never blocks the event loop. These classes raise ``redis`` errors and wait as long as
Redis makes them; ``SharedStore`` puts a deadline on each call and decides what an
outage means.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from redis.asyncio import Redis

#: Hashes looked up per round trip; a chain usually breaks early, so small batches.
_LOOKUP_BATCH = 64


class RedisIndexStore:
    """The prefix index's entries in Redis (see the module docstring for the key layout):
    ``IndexStore``'s operations, as coroutines."""

    def __init__(self, client: Redis, ttl_s: float, prefix: str = "pdd:") -> None:
        self._r = client
        self._ttl = max(1, int(ttl_s))
        self._ttl_s = ttl_s
        self._p = prefix

    def _hkey(self, h: int) -> str:
        return f"{self._p}idx:h:{h}"

    def _ikey(self, instance: str) -> str:
        return f"{self._p}idx:i:{instance}"

    async def add(self, instance: str, hashes: Iterable[int], now: float) -> None:
        await self.add_entries(instance, [(h, now) for h in hashes])

    async def add_entries(self, instance: str, entries: Sequence[tuple[int, float]]) -> None:
        """Insert or refresh with per-entry times (resync keeps the original times)."""
        if not entries:
            return
        pipe = self._r.pipeline(transaction=False)
        for h, seen in entries:
            pipe.hset(self._hkey(h), instance, seen)
            pipe.expire(self._hkey(h), self._ttl)
        ikey = self._ikey(instance)
        pipe.zadd(ikey, {str(h): seen for h, seen in entries})
        pipe.expire(ikey, self._ttl)
        await pipe.execute()

    async def remove(self, instance: str, hashes: Iterable[int]) -> None:
        hashes = list(hashes)
        if not hashes:
            return
        pipe = self._r.pipeline(transaction=False)
        for h in hashes:
            pipe.hdel(self._hkey(h), instance)
        pipe.zrem(self._ikey(instance), *[str(h) for h in hashes])
        await pipe.execute()

    async def clear(self, instance: str) -> None:
        members: list[bytes] = await self._r.zrange(self._ikey(instance), 0, -1)  # type: ignore[assignment]
        await self.remove(instance, [int(m) for m in members])
        await self._r.delete(self._ikey(instance))

    async def holders(self, hashes: Sequence[int], now: float) -> list[set[str]]:
        oldest = now - self._ttl_s
        result: list[set[str]] = []
        for start in range(0, len(hashes), _LOOKUP_BATCH):
            pipe = self._r.pipeline(transaction=False)
            for h in hashes[start : start + _LOOKUP_BATCH]:
                pipe.hgetall(self._hkey(h))
            for entry in await pipe.execute():
                held = {i.decode() for i, seen in entry.items() if float(seen) > oldest}
                result.append(held)
                if not held:
                    return result
        return result

    async def expire(self, now: float) -> int:
        oldest = now - self._ttl_s
        dropped = 0
        async for ikey in self._r.scan_iter(match=f"{self._p}idx:i:*"):
            instance = ikey.decode().removeprefix(f"{self._p}idx:i:")
            stale: list[bytes] = await self._r.zrangebyscore(ikey, "-inf", oldest)  # type: ignore[assignment]
            await self.remove(instance, [int(m) for m in stale])
            dropped += len(stale)
        return dropped


class RedisLoads:
    """Per-replica in-flight counts; a reader sums every other live replica's hash (its
    own counts it has in memory, fresher than what it last wrote)."""

    def __init__(self, client: Redis, replica_id: str, ttl_s: float, prefix: str = "pdd:") -> None:
        self._r = client
        self._key = f"{prefix}load:{replica_id}"
        self._replicas = f"{prefix}replicas"
        self._prefix = prefix
        self._replica_id = replica_id
        self._ttl = max(1, int(ttl_s))

    async def add(self, instance: str, delta: int) -> None:
        pipe = self._r.pipeline(transaction=False)
        pipe.hincrby(self._key, instance, delta)
        pipe.expire(self._key, self._ttl)
        pipe.sadd(self._replicas, self._replica_id)
        await pipe.execute()

    async def publish(self, counts: dict[str, int]) -> None:
        """Replace this replica's counts (heartbeat, and resync after an outage)."""
        pipe = self._r.pipeline(transaction=True)
        pipe.delete(self._key)
        if counts:
            pipe.hset(self._key, mapping=dict[Any, Any](counts))  # redis-py types keys narrowly
        pipe.expire(self._key, self._ttl)
        pipe.sadd(self._replicas, self._replica_id)
        await pipe.execute()

    async def others(self) -> dict[str, int]:
        """The other live replicas' counts summed; members whose hash expired are pruned.

        A replica with nothing in flight has no hash either (Redis drops empty hashes),
        so it may be pruned too; it adds itself back on its next write or heartbeat, and
        had nothing to count meanwhile."""
        members: set[bytes] = await self._r.smembers(self._replicas)  # type: ignore[assignment]
        replicas = [r for r in (m.decode() for m in members) if r != self._replica_id]
        pipe = self._r.pipeline(transaction=False)
        for replica in replicas:
            pipe.hgetall(f"{self._prefix}load:{replica}")
        totals: dict[str, int] = {}
        gone: list[str] = []
        for replica, counts in zip(replicas, await pipe.execute(), strict=True):
            if not counts:
                gone.append(replica)
            for instance, n in counts.items():
                name = instance.decode()
                totals[name] = totals.get(name, 0) + int(n)
        if gone:
            await self._r.srem(self._replicas, *gone)
        return {i: n for i, n in totals.items() if n > 0}
