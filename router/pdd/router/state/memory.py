"""The embedded store of a single router replica (no Redis)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pdd.router.prefix_index import InMemoryIndexStore


class LocalStore:
    """Process memory only; also the fallback a Redis-backed store serves from."""

    shared = False
    reads_waiting = 0

    def __init__(self, ttl_s: float) -> None:
        self._index = InMemoryIndexStore(ttl_s)
        self._inflight: Counter[str] = Counter()

    @property
    def index(self) -> InMemoryIndexStore:
        return self._index

    def add_inflight(self, instance: str, delta: int) -> None:
        self._inflight[instance] += delta
        if self._inflight[instance] <= 0:
            del self._inflight[instance]

    def counts(self) -> dict[str, int]:
        """This replica's in-flight counts, without a coroutine (what a shared store
        publishes and adds to the other replicas')."""
        return dict(self._inflight)

    async def inflight(self) -> dict[str, int]:
        return self.counts()

    async def holders(self, hashes: Sequence[int], now: float) -> list[set[str]]:
        return self._index.holders(hashes, now)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None
