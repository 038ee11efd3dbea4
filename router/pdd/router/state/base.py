"""The contract of a router state store.

A store holds two things replicas must agree on: the prefix index entries (behind
R1's :class:`~pdd.router.prefix_index.IndexStore`) and how many requests each
replica has in flight on each worker (so one replica sees the load another put on
an instance before the worker's own ``/load`` catches up).

Timestamps are wall-clock (``time.time``): replicas on different hosts compare them.
"""

from __future__ import annotations

from typing import Protocol

from pdd.router.prefix_index import IndexStore


class RouterStore(Protocol):
    """Contract: ``add_inflight`` never raises (a shared store that is down degrades
    to local state); ``inflight`` sums every live replica's counts per instance."""

    @property
    def index(self) -> IndexStore: ...

    @property
    def shared(self) -> bool:
        """True while other replicas see what this one writes."""
        ...

    def add_inflight(self, instance: str, delta: int) -> None: ...

    def inflight(self) -> dict[str, int]: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...
