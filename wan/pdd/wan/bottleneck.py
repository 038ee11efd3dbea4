"""The shared bottleneck of the WAN link emulator: one serializer per direction.

A real inter-datacenter line is one pipe: every connection crossing it
queues for the same bits-per-second. So each direction has *one*
``Bottleneck`` that every connection's chunks pass through in turn. A chunk
occupies the line for ``size / rate`` seconds after the previous chunk ends,
and each connection has at most one chunk on the line at a time, so parallel
flows interleave chunk by chunk and share the rate roughly equally.

Propagation delay is *not* modelled here: a chunk that has left the line is
handed to a delay line (see ``wan_pipe``), so RTT adds latency without
reducing throughput, as on a real long fat pipe.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque

GBIT = 1e9
#: The rates a line may be given, Gbit/s: 1 kbit/s (a 64 KiB chunk takes nine minutes,
#: slower than any test's "trickle" needs) to 10 Tbit/s (beyond any real line). Outside
#: them a chunk's time on the line over- or underflows (1e-300 Gbit/s stalls the line for
#: good, 1e308 makes the rate infinite), so they are refused.
MIN_GBPS = 1e-6
MAX_GBPS = 1e4


def check_rate(gbps: float) -> float:
    """``gbps`` where it is a finite rate within the bounds; ValueError saying them."""
    if not (math.isfinite(gbps) and MIN_GBPS <= gbps <= MAX_GBPS):
        raise ValueError(
            f"link rate must be from {MIN_GBPS:g} to {MAX_GBPS:g} Gbit/s (1 kbit/s to "
            f"10 Tbit/s), got {gbps!r}"
        )
    return gbps


class ThroughputMeter:
    """Bytes delivered over the last ``window_s`` seconds (of event-loop time), as bits/s."""

    def __init__(self, window_s: float = 1.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._bytes_in_window = 0

    def add(self, nbytes: int) -> None:
        now = asyncio.get_running_loop().time()
        self._events.append((now, nbytes))
        self._bytes_in_window += nbytes
        self._expire(now)

    def bits_per_second(self) -> float:
        self._expire(asyncio.get_running_loop().time())
        return 8 * self._bytes_in_window / self.window_s

    def _expire(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._bytes_in_window -= self._events.popleft()[1]


class Bottleneck:
    """One direction of the line: a rate, a serialization clock and counters.

    ``burst_s`` is the depth of the token bucket: after a short idle period (or
    a late wake-up of the event loop) up to ``burst_s`` of line time may be
    caught up, so scheduler jitter does not eat into the configured rate.
    """

    def __init__(self, name: str, gbps: float, burst_s: float = 0.005) -> None:
        self.name = name
        self.burst_s = burst_s
        self.bytes_forwarded = 0  # delivered to the far side
        self.meter = ThroughputMeter()
        self._bytes_per_s = 0.0
        self._free_at = 0.0
        #: When each chunk on or queued for the line leaves it (mutable: a rate change
        #: moves them), and the event that wakes their waits to look again.
        self._departures: list[list[float]] = []
        self._rate_changed = asyncio.Event()
        self.set_rate(gbps)

    @property
    def gbps(self) -> float:
        return self._bytes_per_s * 8 / GBIT

    @property
    def bytes_per_s(self) -> float:
        return self._bytes_per_s

    def set_rate(self, gbps: float) -> None:
        """Change the line rate, at once: the bytes not yet serialized (of the chunk on
        the line too) go at the new rate, as on a real line whose rate changes."""
        new = check_rate(gbps) * GBIT / 8
        with contextlib.suppress(RuntimeError):  # no loop yet: nothing is on the line
            now = asyncio.get_running_loop().time()
            scale = self._bytes_per_s / new
            self._free_at = _rescaled(self._free_at, now, scale)
            for departure in self._departures:
                departure[0] = _rescaled(departure[0], now, scale)
        self._bytes_per_s = new
        self._rate_changed.set()
        self._rate_changed = asyncio.Event()

    async def transmit(self, nbytes: int) -> float:
        """Occupy the line for ``nbytes``; returns when (loop time) the last bit left.

        Never earlier than now: catching up on the bucket may skip the wait, but
        it must not shorten the propagation delay that is added after departure.
        """
        loop = asyncio.get_running_loop()
        now = loop.time()
        start = max(self._free_at, now - self.burst_s)
        self._free_at = start + nbytes / self._bytes_per_s
        departure = [self._free_at]
        self._departures.append(departure)
        try:
            while (left := departure[0] - loop.time()) > _TOLERANCE_S:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._rate_changed.wait(), left)
        finally:
            self._departures.remove(departure)
        return max(departure[0], now)

    def delivered(self, nbytes: int) -> None:
        self.bytes_forwarded += nbytes
        self.meter.add(nbytes)


#: A departure this close is now: a shorter wait may not move a clock (a virtual one adds
#: it to a large float and gets the same float back), and would then never end.
_TOLERANCE_S = 1e-9


def _rescaled(at: float, now: float, scale: float) -> float:
    """A departure still ahead of ``now``, with the time left multiplied by ``scale``."""
    return now + (at - now) * scale if at > now else at
