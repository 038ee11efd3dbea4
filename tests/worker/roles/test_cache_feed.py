"""The cache-event feed the router polls (``pdd.worker.roles.cache_feed``): cursors, and
when a subscriber must rebuild its view of the instance (``reset``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from pdd.common.cache_events import AllCleared, BlockStored
from pdd.worker.roles.cache_feed import CacheFeed

pytestmark = pytest.mark.unit


@dataclass
class _Cache:
    """What the feed reads of an engine: its new events and how many it ever dropped."""

    pending: list[Any] = field(default_factory=list)
    num_dropped_cache_events: int = 0

    def drain_cache_events(self) -> list[Any]:
        events, self.pending = self.pending, []
        return events


class _Runner:
    def __init__(self, engine: _Cache) -> None:
        self.engine = engine

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        return fn(self.engine)


def _stored(h: int) -> BlockStored:
    return BlockStored(block_hashes=[h], parent_hash=None, block_size=16)


@pytest.fixture
def cache() -> _Cache:
    return _Cache()


@pytest.fixture
def feed(cache: _Cache) -> CacheFeed:
    return CacheFeed(_Runner(cache), "md-0")  # type: ignore[arg-type]


async def test_a_subscriber_gets_what_follows_its_cursor(cache, feed) -> None:
    cache.pending = [_stored(1), _stored(2)]
    first = await feed.page(0)
    assert (first.next_cursor, first.reset, len(first.events)) == (2, False, 2)
    cache.pending = [_stored(3)]
    second = await feed.page(first.next_cursor)
    assert (second.next_cursor, second.reset) == (3, False)
    assert [e.block_hashes for e in second.events] == [[3]]


async def test_a_subscriber_that_was_current_when_events_were_dropped_is_reset(
    cache, feed
) -> None:
    cache.pending = [_stored(1)]
    seen = (await feed.page(0)).next_cursor  # the router is up to date
    cache.num_dropped_cache_events = 5  # then the engine's buffer overflowed
    cache.pending = [_stored(9)]
    page = await feed.page(seen)
    assert page.reset  # it missed the five: its view of this instance is wrong
    assert [e.block_hashes for e in page.events] == [[1], [9]]  # rebuild from what is kept


async def test_after_a_reset_an_idle_feed_does_not_reset_again(cache, feed) -> None:
    cache.pending = [_stored(1)]
    seen = (await feed.page(0)).next_cursor
    cache.num_dropped_cache_events = 1  # a drop, and no event after it
    page = await feed.page(seen)
    assert page.reset
    again = await feed.page(page.next_cursor)
    assert (again.reset, again.events) == (False, [])


async def test_a_cursor_from_another_life_of_the_worker_is_reset(cache, feed) -> None:
    cache.pending = [AllCleared()]
    page = await feed.page(40)  # ahead of anything this feed numbered
    assert page.reset and page.next_cursor == 1
