"""Cache events for the router: the prefix cache's events, numbered, kept for polling.

The router polls ``GET /v1/pdd/cache-events?since=N``. Each event gets a cursor
(1, 2, ...) in the order the cache produced it; a page holds the events after
``since``. A subscriber whose cursor is older than what is kept (or than a
drop in the cache's own buffer), or from a previous life of this worker, is
told to ``reset``: rebuild its view of this instance from what follows.
"""

from __future__ import annotations

from collections import deque

from pdd.common.wire import CacheEvent, CacheEventsPage
from pdd.worker.engine import Engine
from pdd.worker.engine_runner import EngineRunner


class CacheFeed:
    def __init__(self, runner: EngineRunner, instance_id: str, capacity: int = 10_000) -> None:
        self._runner = runner
        self._instance_id = instance_id
        self._events: deque[tuple[int, CacheEvent]] = deque(maxlen=capacity)
        self._last = 0  # cursor of the newest event
        self._valid_after = 0  # events at or before this cursor may be missing
        self._dropped_seen = 0

    async def page(self, since: int) -> CacheEventsPage:
        await self._pull()
        reset = since > self._last or since < self._oldest_complete_cursor()
        start = 0 if reset else since
        events = [e for cursor, e in self._events if cursor > start]
        return CacheEventsPage(
            instance_id=self._instance_id, next_cursor=self._last, reset=reset, events=events
        )

    def _oldest_complete_cursor(self) -> int:
        oldest_kept = self._events[0][0] - 1 if self._events else self._last
        return max(oldest_kept, self._valid_after)

    async def _pull(self) -> None:
        def drain(engine: Engine) -> tuple[list[CacheEvent], int]:
            return engine.drain_cache_events(), engine.num_dropped_cache_events

        events, dropped = await self._runner.call(drain)
        if dropped > self._dropped_seen:
            # The lost events get a cursor of their own, which no subscriber can have
            # seen: one that was current before them is reset, and once reset (its cursor
            # now this one or later) it is not reset again while the feed stays idle.
            self._dropped_seen = dropped
            self._last += 1
            self._valid_after = self._last
        for event in events:
            self._last += 1
            self._events.append((self._last, event))
