"""Prefix-cache events: the wire format a router subscribes to.

A worker's prefix cache reports every block it adopts and every block it evicts,
named by the chained hashes of ``pdd.common.block_hash``. Because a block's hash
covers its whole prefix, the router can keep "which instance holds which prefix"
without ever seeing token IDs or KV. Events are buffered in the cache until someone
drains them; the buffer is bounded (a worker with no subscriber must not grow
without limit) and counts what it dropped, so a subscriber that sees a nonzero
count knows its view has gaps and must resynchronise.
"""

from __future__ import annotations

from collections import deque
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class BlockStored(_Event):
    """Consecutive full blocks newly cached, in prefix order (root side first)."""

    type: Literal["block_stored"] = "block_stored"
    block_hashes: list[int] = Field(min_length=1)
    #: Hash of the block just before ``block_hashes[0]``; None when the first stored
    #: block is the first block of the sequence (its hash chain starts at ROOT_HASH).
    parent_hash: int | None
    block_size: int = Field(gt=0)
    #: The stored blocks' token IDs, only when the cache was built to include them.
    token_ids: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.block_hashes) * self.block_size


class BlockRemoved(_Event):
    """Blocks evicted from the cache (any order; each hash names a whole prefix)."""

    type: Literal["block_removed"] = "block_removed"
    block_hashes: list[int] = Field(min_length=1)


class AllCleared(_Event):
    """The cache was reset: every block this worker reported before is gone."""

    type: Literal["all_cleared"] = "all_cleared"


CacheEvent = Annotated[BlockStored | BlockRemoved | AllCleared, Field(discriminator="type")]

#: Parses one event or a list of events from JSON, dispatching on ``type``.
CACHE_EVENT_ADAPTER: TypeAdapter[CacheEvent] = TypeAdapter(CacheEvent)
CACHE_EVENT_LIST_ADAPTER: TypeAdapter[list[CacheEvent]] = TypeAdapter(list[CacheEvent])


class EventBuffer:
    """Bounded FIFO of events; when full the oldest event is dropped and counted."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"event buffer capacity must be positive, got {capacity}")
        self._events: deque[CacheEvent] = deque()
        self._capacity = capacity
        self._num_dropped = 0

    @property
    def num_dropped(self) -> int:
        """Events lost to overflow since the buffer was created (never reset)."""
        return self._num_dropped

    def __len__(self) -> int:
        return len(self._events)

    def append(self, event: CacheEvent) -> None:
        if len(self._events) == self._capacity:
            self._events.popleft()
            self._num_dropped += 1
        self._events.append(event)

    def drain(self) -> list[CacheEvent]:
        """Return every buffered event, oldest first, and empty the buffer."""
        events = list(self._events)
        self._events.clear()
        return events
