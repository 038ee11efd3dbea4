"""Prefix index entries and in-flight counts in Redis, shared by router replicas.

Layout (every key under ``prefix``, default ``pdd:``):

* ``idx:h:<hash>``: HASH instance -> last seen; the per-block lookup.
* ``idx:i:<instance>``: ZSET hash scored by last seen; for clear and expiry.
* ``load:<replica>``: HASH instance -> requests that replica has in flight; it
  expires unless the replica refreshes it, so a dead replica's load fades out.
* ``replicas``: SET of replica ids that ever wrote a load hash.

Index keys also carry a Redis TTL, so entries of instances nobody expires any more
cannot pile up. These classes raise ``redis`` errors; ``SharedStore`` decides what
an outage means.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import redis

#: Hashes looked up per round trip; a chain usually breaks early, so small batches.
_LOOKUP_BATCH = 64


class RedisIndexStore:
    """An ``IndexStore`` in Redis (see the module docstring for the key layout)."""

    def __init__(self, client: redis.Redis, ttl_s: float, prefix: str = "pdd:") -> None:
        self._r = client
        self._ttl = max(1, int(ttl_s))
        self._ttl_s = ttl_s
        self._p = prefix

    def _hkey(self, h: int) -> str:
        return f"{self._p}idx:h:{h}"

    def _ikey(self, instance: str) -> str:
        return f"{self._p}idx:i:{instance}"

    def add(self, instance: str, hashes: Iterable[int], now: float) -> None:
        self.add_entries(instance, [(h, now) for h in hashes])

    def add_entries(self, instance: str, entries: Sequence[tuple[int, float]]) -> None:
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
        pipe.execute()

    def remove(self, instance: str, hashes: Iterable[int]) -> None:
        hashes = list(hashes)
        if not hashes:
            return
        pipe = self._r.pipeline(transaction=False)
        for h in hashes:
            pipe.hdel(self._hkey(h), instance)
        pipe.zrem(self._ikey(instance), *[str(h) for h in hashes])
        pipe.execute()

    def clear(self, instance: str) -> None:
        members: list[bytes] = self._r.zrange(self._ikey(instance), 0, -1)  # type: ignore[assignment]
        self.remove(instance, [int(m) for m in members])
        self._r.delete(self._ikey(instance))

    def holders(self, hashes: Sequence[int], now: float) -> list[set[str]]:
        oldest = now - self._ttl_s
        result: list[set[str]] = []
        for start in range(0, len(hashes), _LOOKUP_BATCH):
            pipe = self._r.pipeline(transaction=False)
            for h in hashes[start : start + _LOOKUP_BATCH]:
                pipe.hgetall(self._hkey(h))
            for entry in pipe.execute():
                held = {i.decode() for i, seen in entry.items() if float(seen) > oldest}
                result.append(held)
                if not held:
                    return result
        return result

    def expire(self, now: float) -> int:
        oldest = now - self._ttl_s
        dropped = 0
        for ikey in self._r.scan_iter(match=f"{self._p}idx:i:*"):
            instance = ikey.decode().removeprefix(f"{self._p}idx:i:")
            stale: list[bytes] = self._r.zrangebyscore(ikey, "-inf", oldest)  # type: ignore[assignment]
            self.remove(instance, [int(m) for m in stale])
            dropped += len(stale)
        return dropped


class RedisLoads:
    """Per-replica in-flight counts; readers sum every replica's hash."""

    def __init__(
        self, client: redis.Redis, replica_id: str, ttl_s: float, prefix: str = "pdd:"
    ) -> None:
        self._r = client
        self._key = f"{prefix}load:{replica_id}"
        self._replicas = f"{prefix}replicas"
        self._prefix = prefix
        self._replica_id = replica_id
        self._ttl = max(1, int(ttl_s))

    def add(self, instance: str, delta: int) -> None:
        pipe = self._r.pipeline(transaction=False)
        pipe.hincrby(self._key, instance, delta)
        pipe.expire(self._key, self._ttl)
        pipe.sadd(self._replicas, self._replica_id)
        pipe.execute()

    def publish(self, counts: dict[str, int]) -> None:
        """Replace this replica's counts (heartbeat, and resync after an outage)."""
        pipe = self._r.pipeline(transaction=True)
        pipe.delete(self._key)
        if counts:
            pipe.hset(self._key, mapping=dict[Any, Any](counts))  # redis-py types keys narrowly
        pipe.expire(self._key, self._ttl)
        pipe.sadd(self._replicas, self._replica_id)
        pipe.execute()

    def total(self) -> dict[str, int]:
        replicas: set[bytes] = self._r.smembers(self._replicas)  # type: ignore[assignment]
        pipe = self._r.pipeline(transaction=False)
        for replica in replicas:
            pipe.hgetall(f"{self._prefix}load:{replica.decode()}")
        totals: dict[str, int] = {}
        for counts in pipe.execute():
            for instance, n in counts.items():
                name = instance.decode()
                totals[name] = totals.get(name, 0) + int(n)
        return {i: n for i, n in totals.items() if n > 0}
