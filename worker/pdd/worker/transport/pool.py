"""ChannelPool: warm, authenticated channels to each peer, one conversation at a time.

Opening a WAN channel costs round trips before the first useful byte: TCP's, TLS's
where it is on, and the HMAC handshake's (``peer_auth``). Across a 30 ms line that is
most of a P-MD request's fixed cost, so P keeps the channels it opened to each MD (and
to each relay, whose handshake waits on two busy event loops instead), as MD keeps its
channels to each relay for the hand-off, and reuses them (what HTTP/1.1
keep-alive pools do): ``take`` hands out an idle open channel, or opens one;
``give_back`` keeps a channel whose conversation ended cleanly; ``warm`` opens spares in
the background (the caller does after every ``take``), so the next conversation finds
one warm. Spares are opened on first contact with a peer and kept from then on.

Why a pool and not many requests multiplexed on one channel: flow control is per
channel (``channel.py``), so one receiver slow to import would hold the credit of
every request sharing its channel (head-of-line blocking), and a timeout or a bad
frame fails the channel, which would fail every request on it. One conversation per
channel at a time keeps each transfer's faults its own, exactly as with a channel per
request; the price is a socket per concurrent transfer, and at most ``max_idle``
kept per peer.

A channel the peer or the line closed is noticed by its reader at once and dropped
when it comes up; a line that silently swallows bytes is found by the conversation
itself (the receiver's answer does not come within the connect timeout), which then
closes the channel instead of giving it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from pdd.worker.transport.channel import Channel
from pdd.worker.transport.errors import TransportError

log = logging.getLogger(__name__)

Opener = Callable[[], Awaitable[Channel]]
#: Opens a channel to the peer; ``True``: a spare, opened ahead of need (its failure is
#: not a transfer's).
SpareOpener = Callable[[bool], Awaitable[Channel]]


class ChannelPool:
    """Idle channels per peer key; ``spares`` kept warm, at most ``max_idle`` kept."""

    def __init__(self, spares: int = 1, max_idle: int = 8) -> None:
        if not 0 <= spares <= max_idle:
            raise ValueError(f"need 0 <= spares ({spares}) <= max_idle ({max_idle})")
        self.spares = spares
        self.max_idle = max_idle
        self._idle: dict[str, list[Channel]] = {}
        #: Per peer, the tasks opening spares to it now (each leaves once it ends).
        self._warming: dict[str, set[asyncio.Task[None]]] = {}
        self._closed = False

    def warming(self, key: str) -> int:
        """Spares to ``key`` being opened now."""
        return len(self._warming.get(key, ()))

    def idle(self, key: str) -> int:
        """Open channels to ``key`` waiting for a conversation."""
        return sum(1 for c in self._idle.get(key, []) if c.is_open)

    async def take(self, key: str, opener: Opener) -> Channel:
        """A warm channel to ``key`` if one is idle, else a new one from ``opener`` (its
        errors propagate)."""
        idle = self._idle.setdefault(key, [])
        channel = None
        while idle and channel is None:
            candidate = idle.pop()
            if candidate.is_open:
                channel = candidate
            else:
                await candidate.close()
        if channel is None:
            channel = await opener()
        return channel

    async def take_warm(self, key: str, opener: SpareOpener) -> Channel:
        """``take`` (``opener(False)`` where none is idle), then ``warm`` (``opener(True)``):
        the channel a conversation needs now, and spares kept for the next."""
        channel = await self.take(key, lambda: opener(False))
        self.warm(key, lambda: opener(True))
        return channel

    async def release(self, key: str, channel: Channel, reusable: bool) -> None:
        """After a conversation: ``give_back`` a channel whose conversation ended cleanly
        (``reusable``); close any other."""
        if reusable:
            await self.give_back(key, channel)
            return
        with contextlib.suppress(Exception):
            await channel.close()

    async def give_back(self, key: str, channel: Channel) -> None:
        """Keep ``channel`` for the next conversation with ``key`` (its last one ended
        cleanly), unless it failed or the pool is full or closed."""
        idle = self._idle.setdefault(key, [])
        if self._closed or not channel.is_open or len(idle) >= self.max_idle:
            await channel.close()
            return
        idle.append(channel)

    def warm(self, key: str, opener: Opener) -> list[asyncio.Task[None]]:
        """Open channels to ``key`` in the background until ``spares`` are idle or opening;
        the tasks opening spares to it now, started here or before, for a caller that
        waits for them (each ends with its spare idle, or failed and logged)."""
        warming = self._warming.setdefault(key, set())
        missing = 0 if self._closed else self.spares - self.idle(key) - len(warming)
        for _ in range(max(0, missing)):
            task = asyncio.ensure_future(self._open_spare(key, opener))
            warming.add(task)
            task.add_done_callback(warming.discard)
        return list(warming)

    async def _open_spare(self, key: str, opener: Opener) -> None:
        """One spare; a failure is only logged: the next ``take`` opens (and reports) its own."""
        try:
            channel = await opener()
            await self.give_back(key, channel)
        except TransportError as exc:
            log.info("could not open a spare channel to %s: %s", key, exc)

    async def close(self) -> None:
        """Close every idle channel and stop warming."""
        self._closed = True
        tasks = [task for warming in self._warming.values() for task in warming]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        for idle in self._idle.values():
            for channel in idle:
                await channel.close()
        self._idle.clear()
