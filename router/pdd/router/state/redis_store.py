"""Prefix index entries and in-flight counts in Redis, shared by router replicas.

Layout (every key under ``prefix``, default ``pdd:``):

* ``idx:h:<hash>``: HASH instance -> last seen; the per-block lookup.
* ``idx:i:<instance>``: ZSET hash scored by last seen; for clear and expiry.
* ``load:<replica>``: HASH instance -> requests that replica has in flight; it
  expires unless the replica refreshes it, so a dead replica's load fades out.
* ``replicas:seen``: ZSET replica id -> when its entry expires (Unix time: its last
  write plus its load TTL). Every write and heartbeat drops the expired members, and
  the key itself expires with the last of them, so a replica that is gone (SIGKILLed,
  rescheduled under a new id) leaves the set within its TTL even if no other replica
  ever reads it, and one that stops cleanly leaves at once (``leave``). However often
  replicas restart, the set holds the live ones.

Index keys also carry a Redis TTL, so entries of instances nobody expires any more
cannot pile up. The client is ``redis.asyncio``: every call here is a coroutine and
never blocks the event loop. These classes raise ``redis`` errors and wait as long as
Redis makes them; ``SharedStore`` puts a deadline on each call and decides what an
outage means.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

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

    def __init__(
        self,
        client: Redis,
        replica_id: str,
        ttl_s: float,
        prefix: str = "pdd:",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._r = client
        self._key = f"{prefix}load:{replica_id}"
        self._replicas = f"{prefix}replicas:seen"
        self._prefix = prefix
        self._replica_id = replica_id
        self._ttl = max(1, int(ttl_s))
        self._clock = clock  # Unix time: replicas on other hosts compare it

    def _seen(self, pipe: Pipeline) -> None:
        """Mark this replica alive for a TTL, and drop those whose mark expired."""
        now = self._clock()
        pipe.zadd(self._replicas, {self._replica_id: now + self._ttl})
        pipe.zremrangebyscore(self._replicas, "-inf", now)
        pipe.expire(self._replicas, self._ttl)  # gone with the last live replica

    async def add(self, instance: str, delta: int) -> None:
        pipe = self._r.pipeline(transaction=False)
        pipe.hincrby(self._key, instance, delta)
        pipe.expire(self._key, self._ttl)
        self._seen(pipe)
        await pipe.execute()

    async def publish(self, counts: dict[str, int]) -> None:
        """Replace this replica's counts (heartbeat, and resync after an outage)."""
        pipe = self._r.pipeline(transaction=True)
        pipe.delete(self._key)
        if counts:
            pipe.hset(self._key, mapping=dict[Any, Any](counts))  # redis-py types keys narrowly
        pipe.expire(self._key, self._ttl)
        self._seen(pipe)
        await pipe.execute()

    async def leave(self) -> None:
        """This replica stops: its counts and its id go now, not a TTL later."""
        pipe = self._r.pipeline(transaction=True)
        pipe.delete(self._key)
        pipe.zrem(self._replicas, self._replica_id)
        await pipe.execute()

    async def others(self) -> dict[str, int]:
        """The other live replicas' counts summed (those whose mark has not expired)."""
        members: list[bytes] = await self._r.zrangebyscore(self._replicas, self._clock(), "+inf")  # type: ignore[assignment]
        replicas = [r for r in (m.decode() for m in members) if r != self._replica_id]
        pipe = self._r.pipeline(transaction=False)
        for replica in replicas:
            pipe.hgetall(f"{self._prefix}load:{replica}")
        totals: dict[str, int] = {}
        for counts in await pipe.execute():
            for instance, n in counts.items():
                name = instance.decode()
                totals[name] = totals.get(name, 0) + int(n)
        return {i: n for i, n in totals.items() if n > 0}
