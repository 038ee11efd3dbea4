"""The contract of a router state store.

A store holds two things replicas must agree on: the prefix index entries (behind
R1's :class:`~pdd.router.prefix_index.IndexStore`) and how many requests each
replica has in flight on each worker (so one replica sees the load another put on
an instance before the worker's own ``/load`` catches up).

Timestamps are wall-clock (``time.time``): replicas on different hosts compare them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from pdd.router.prefix_index import IndexStore


class RouterStore(Protocol):
    """Contract: ``add_inflight`` never raises nor waits (a shared store sends it behind);
    ``inflight`` sums every live replica's counts per instance (valid until the next
    await: read it at once; a shared store may give the other replicas' counts as read
    a moment ago, its own always current) and ``holders`` is the
    index lookup of the decision path (``IndexStore.holders``): both are awaited, never
    raise, and return within the store's deadline (a shared store that is down or hung
    answers from local state)."""

    @property
    def index(self) -> IndexStore: ...

    @property
    def shared(self) -> bool:
        """True while other replicas see what this one writes."""
        ...

    def add_inflight(self, instance: str, delta: int) -> None: ...

    @property
    def reads_waiting(self) -> int:
        """Reads waiting on the shared store now (what a hung Redis holds)."""
        ...

    async def inflight(self) -> Mapping[str, int]: ...

    def take_moved(self) -> set[str]:
        """The instances whose summed count may have changed since the last call (this
        replica's leases, and what the last ``inflight`` read of the others changed)."""
        ...

    async def holders(self, hashes: Sequence[int], now: float) -> list[set[str]]: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...
