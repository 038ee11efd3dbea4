"""The embedded store of a single router replica (no Redis)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from pdd.router.prefix_index import InMemoryIndexStore


class LocalStore:
    """Process memory only; also the fallback a Redis-backed store serves from."""

    shared = False
    reads_waiting = 0

    def __init__(self, ttl_s: float) -> None:
        self._index = InMemoryIndexStore(ttl_s)
        self._inflight: Counter[str] = Counter()
        self._moved: set[str] = set()

    @property
    def index(self) -> InMemoryIndexStore:
        return self._index

    def add_inflight(self, instance: str, delta: int) -> None:
        self._inflight[instance] += delta
        if self._inflight[instance] <= 0:
            del self._inflight[instance]
        self._moved.add(instance)

    def take_moved(self) -> set[str]:
        """The instances whose count changed since the last call: the router updates
        only those, not the whole fleet, per request."""
        moved, self._moved = self._moved, set()
        return moved

    def counts(self) -> dict[str, int]:
        """This replica's in-flight counts, without a coroutine (what a shared store
        publishes and adds to the other replicas')."""
        return dict(self._inflight)

    def live_counts(self) -> Mapping[str, int]:
        """The live counts, read-only (no copy per request: see ``take_moved``)."""
        return MappingProxyType(self._inflight)

    async def inflight(self) -> Mapping[str, int]:
        return self.live_counts()

    async def holders(self, hashes: Sequence[int], now: float) -> list[set[str]]:
        return self._index.holders(hashes, now)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None
