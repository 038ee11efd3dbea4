"""ChannelPool: reuse, warm spares, dropping dead channels; with stand-in channels (no sockets)."""

from __future__ import annotations

import asyncio

import pytest

from pdd.worker.transport import LinkDown
from pdd.worker.transport.pool import ChannelPool

pytestmark = pytest.mark.unit


class FakeChannel:
    """What the pool uses of a Channel: ``is_open`` and ``close()``."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.is_open = True

    async def close(self) -> None:
        self.is_open = False


class Opener:
    """Opens numbered fake channels, or fails while ``down``."""

    def __init__(self) -> None:
        self.opened: list[FakeChannel] = []
        self.down = False

    async def __call__(self) -> FakeChannel:
        if self.down:
            raise LinkDown("line is down")
        channel = FakeChannel(len(self.opened))
        self.opened.append(channel)
        return channel


async def settle(pool: ChannelPool, key: str, opener: Opener) -> None:
    """Wait until the spares being opened in the background are in (or failed)."""
    await asyncio.gather(*pool.warm(key, opener))


async def test_a_channel_given_back_is_taken_again() -> None:
    pool, opener = ChannelPool(spares=0), Opener()
    first = await pool.take("md", opener)
    await pool.give_back("md", first)
    assert await pool.take("md", opener) is first
    assert len(opener.opened) == 1


async def test_warm_keeps_spares_ready() -> None:
    pool, opener = ChannelPool(spares=2), Opener()
    taken = await pool.take("md", opener)
    pool.warm("md", opener)
    pool.warm("md", opener)  # already warming: no more than the spares
    await settle(pool, "md", opener)
    assert pool.idle("md") == 2 and len(opener.opened) == 3
    assert await pool.take("md", opener) is not taken


async def test_closed_channels_are_dropped_not_handed_out() -> None:
    pool, opener = ChannelPool(spares=0), Opener()
    dead = await pool.take("md", opener)
    await pool.give_back("md", dead)
    dead.is_open = False  # the peer or the line closed it while it idled
    fresh = await pool.take("md", opener)
    assert fresh is not dead and fresh.is_open


async def test_failed_channels_and_overflow_are_closed() -> None:
    pool, opener = ChannelPool(spares=0, max_idle=1), Opener()
    a, b = await pool.take("md", opener), await pool.take("md", opener)
    await pool.give_back("md", a)
    await pool.give_back("md", b)  # the pool is full: closed
    assert a.is_open and not b.is_open and pool.idle("md") == 1


async def test_a_spare_that_cannot_connect_is_no_error_and_take_reports_its_own() -> None:
    pool, opener = ChannelPool(spares=1), Opener()
    opener.down = True
    pool.warm("md", opener)
    await settle(pool, "md", opener)
    assert pool.idle("md") == 0
    with pytest.raises(LinkDown):
        await pool.take("md", opener)


async def test_close_closes_idle_channels_and_refuses_more() -> None:
    pool, opener = ChannelPool(spares=0), Opener()
    kept = await pool.take("md", opener)
    await pool.give_back("md", kept)
    await pool.close()
    assert not kept.is_open
    late = await pool.take("md", opener)
    await pool.give_back("md", late)
    assert not late.is_open


def test_spares_must_fit_the_pool() -> None:
    with pytest.raises(ValueError, match="spares"):
        ChannelPool(spares=3, max_idle=2)


async def test_take_warm_opens_now_then_a_spare_and_release_keeps_only_clean_ends() -> None:
    pool, opener = ChannelPool(spares=1), Opener()
    spares: list[bool] = []

    def opens(spare: bool):
        spares.append(spare)
        return opener()

    taken = await pool.take_warm("md", opens)
    await settle(pool, "md", opener)
    assert spares == [False, True] and pool.idle("md") == 1  # the one now, then a spare
    await pool.release("md", taken, reusable=False)  # a failed conversation: closed
    assert not taken.is_open and pool.idle("md") == 1
    kept = await pool.take_warm("md", opens)
    await pool.release("md", kept, reusable=True)
    assert kept.is_open and pool.idle("md") >= 1 and await pool.take("md", opener) is kept
