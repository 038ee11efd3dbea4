"""A Redis-shared store that survives Redis going away.

Every write lands in a local store *and* (while Redis answers) in Redis; reads come
from Redis while it answers, else from the local store. So losing Redis costs only
what other replicas saw since (their load and cache events), never a request. When
Redis answers again, this replica re-seeds it from its local state (index entries
with their original times, and its in-flight counts) before reading from it again:
a restarted, empty Redis would otherwise make every replica forget every prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import redis

from pdd.router.prefix_index import IndexStore
from pdd.router.state.memory import LocalStore
from pdd.router.state.redis_store import RedisIndexStore, RedisLoads

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Socket timeouts small enough that a dead Redis costs one request a fraction of a
#: second before the store switches to local state.
_SOCKET_TIMEOUT_S = 0.5


class SharedStore:
    def __init__(
        self,
        url: str,
        replica_id: str,
        ttl_s: float,
        heartbeat_s: float = 1.0,
        prefix: str = "pdd:",
        on_change: Callable[[bool], None] = lambda up: None,
    ) -> None:
        self._local = LocalStore(ttl_s)
        self._client = redis.Redis.from_url(
            url, socket_timeout=_SOCKET_TIMEOUT_S, socket_connect_timeout=_SOCKET_TIMEOUT_S
        )
        self._redis_index = RedisIndexStore(self._client, ttl_s, prefix)
        self._loads = RedisLoads(self._client, replica_id, 5 * heartbeat_s, prefix)
        self._heartbeat_s = heartbeat_s
        self._on_change = on_change
        self._up = False
        self._index = _FailoverIndex(self, self._local.index, self._redis_index)
        self._task: asyncio.Task | None = None

    @property
    def index(self) -> IndexStore:
        return self._index

    @property
    def shared(self) -> bool:
        return self._up

    def add_inflight(self, instance: str, delta: int) -> None:
        self._local.add_inflight(instance, delta)
        self.call(lambda: self._loads.add(instance, delta))

    def inflight(self) -> dict[str, int]:
        total = self.call(self._loads.total)
        return total if total is not None else self._local.inflight()

    def call(self, op: Callable[[], T]) -> T | None:
        """Run ``op`` against Redis while it is up; None (and mark it down) if it fails."""
        if not self._up:
            return None
        try:
            return op()
        except redis.RedisError as exc:
            self._set_up(False, f"{exc!r}; serving from local state")
            return None

    async def start(self) -> None:
        await self._try_resync()
        self._task = asyncio.create_task(self._watch(), name="redis-watch")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._client.close()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_s)
            if self._up:
                self.call(lambda: self._loads.publish(self._local.inflight()))
            else:
                await self._try_resync()

    async def _try_resync(self) -> None:
        """Probe off the event loop (a dead host may time out); re-seed on the loop, so no
        write slips between the snapshot and the switch back to Redis."""
        try:
            await asyncio.to_thread(self._client.ping)
            entries = self._local.index.entries()
            by_instance: dict[str, list[tuple[int, float]]] = {}
            for instance, h, seen in entries:
                by_instance.setdefault(instance, []).append((h, seen))
            for instance, items in by_instance.items():
                self._redis_index.add_entries(instance, items)
            self._loads.publish(self._local.inflight())
        except redis.RedisError as exc:
            if self._task is None:  # first attempt: say why once
                log.warning("redis unavailable at start (%r): serving from local state", exc)
            return
        self._set_up(True, f"re-seeded {len(entries)} index entries")

    def _set_up(self, up: bool, detail: str) -> None:
        if up == self._up:
            return
        self._up = up
        if up:
            log.info("redis store available: %s", detail)
        else:
            log.warning("redis store lost: %s", detail)
        self._on_change(up)


class _FailoverIndex:
    """Writes go to both stores, reads to Redis while it answers."""

    def __init__(self, store: SharedStore, local: IndexStore, remote: RedisIndexStore) -> None:
        self._store, self._local, self._remote = store, local, remote

    def add(self, instance: str, hashes: Iterable[int], now: float) -> None:
        hashes = list(hashes)
        self._local.add(instance, hashes, now)
        self._store.call(lambda: self._remote.add(instance, hashes, now))

    def remove(self, instance: str, hashes: Iterable[int]) -> None:
        hashes = list(hashes)
        self._local.remove(instance, hashes)
        self._store.call(lambda: self._remote.remove(instance, hashes))

    def clear(self, instance: str) -> None:
        self._local.clear(instance)
        self._store.call(lambda: self._remote.clear(instance))

    def holders(self, hashes: Sequence[int], now: float) -> list[set[str]]:
        remote = self._store.call(lambda: self._remote.holders(hashes, now))
        return remote if remote is not None else self._local.holders(hashes, now)

    def expire(self, now: float) -> int:
        self._store.call(lambda: self._remote.expire(now))
        return self._local.expire(now)
