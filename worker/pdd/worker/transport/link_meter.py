"""Per-link WAN measurements: goodput, RTT, backlog, failures, per (src, dst) instance pair.

Pure on purpose (no asyncio, no torch, no clock of its own: every call passes ``now``
in seconds of the caller's clock). The worker's channel ends feed it (see
``pdd.worker.transport.metering``) and export it to Prometheus. It is the line as the
workers see it, frame by frame; the router decides on its own estimate
(``pdd.common.link_estimator``, shared with the simulator), learnt from each transfer's
dispatch-to-landing time, because the router sees no frame. The two are separate
measurements of one line: a dashboard that sets them side by side shows how far the
router's view is from the workers'.

A link is directed: ``src`` sends, ``dst`` receives. Both ends of a channel measure it,
each with what it can see (``LinkMeter``'s methods say which end calls what).

Why these estimators:

- **Goodput** is bytes *delivered* over a sliding window (``window_s``, in buckets of
  ``window_s / BUCKETS``): counted at the receiver as frames arrive, at the sender when
  the receiver's flow-control credit confirms them. Never at the sender's socket: a
  socket and the line's queue swallow a burst at memory speed, which would read as a
  spike far above the line rate at every transfer's start. An idle link decays to 0
  within one window, as ``rate()`` over a counter would.
- **RTT** has two numbers. ``rtt_s`` is TCP's smoothed RTT (RFC 6298, gain 1/8): it
  follows the current round trip, standing queue included. ``rtt_min_s`` is the
  minimum over ``rtt_min_window_s`` (the way BBR estimates propagation delay): samples
  are taken in application code on a loaded event loop, so any one of them can be late
  by a stall but never early; the minimum is the line's own delay, and ``rtt_s -
  rtt_min_s`` the queueing on top of it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

#: Buckets per goodput window: the window slides in steps of ``window_s / BUCKETS``, so a
#: rate read mid-bucket is off by at most one bucket's bytes (2 % of a full window).
BUCKETS = 50
#: RFC 6298's gain for the smoothed RTT.
SRTT_GAIN = 1 / 8


@dataclass(frozen=True)
class LinkKey:
    """One directed link: instance ``src`` sends to instance ``dst``; pools are their roles."""

    src: str
    dst: str
    src_pool: str
    dst_pool: str

    @property
    def reverse(self) -> LinkKey:
        return LinkKey(self.dst, self.src, self.dst_pool, self.src_pool)


@dataclass(frozen=True)
class LinkSnapshot:
    """What one end knows about a link at one instant."""

    goodput_bps: float  # bytes per second delivered, over the window
    rtt_s: float | None  # smoothed RTT; None before the first sample
    rtt_min_s: float | None  # windowed minimum RTT (propagation delay)
    queued_bytes: int  # committed to the link by the sender, not yet sent
    in_flight_bytes: int  # sent, not yet confirmed by the receiver
    failures: dict[str, int]  # transfers that failed, by reason
    timeouts: int  # waits for the peer that ran out


class Goodput:
    """Bytes delivered in the last ``window_s`` seconds, in fixed buckets (bounded memory)."""

    def __init__(self, window_s: float, now: float) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.window_s = window_s
        self._width = window_s / BUCKETS
        self._since = now  # a young link's rate is over its age, not a mostly empty window
        self._buckets: deque[tuple[int, int]] = deque()  # (bucket index, bytes)
        self._total = 0

    def add(self, nbytes: int, now: float) -> None:
        index = int(now // self._width)
        if self._buckets and self._buckets[-1][0] == index:
            self._buckets[-1] = (index, self._buckets[-1][1] + nbytes)
        else:
            self._buckets.append((index, nbytes))
        self._total += nbytes
        self._expire(now)

    def rate(self, now: float) -> float:
        """Bytes per second over the window (over the link's age while that is shorter)."""
        self._expire(now)
        span = min(self.window_s, max(self._width, now - self._since))
        return self._total / span

    def _expire(self, now: float) -> None:
        oldest = int(now // self._width) - BUCKETS  # buckets at or before it left the window
        while self._buckets and self._buckets[0][0] <= oldest:
            self._total -= self._buckets.popleft()[1]


class RttEstimator:
    """Smoothed RTT (RFC 6298) and the minimum over a window (a monotonic deque)."""

    def __init__(self, min_window_s: float) -> None:
        self.min_window_s = min_window_s
        self.srtt: float | None = None
        self._mins: deque[tuple[float, float]] = deque()  # (time, rtt), rtt increasing

    def add(self, rtt_s: float, now: float) -> None:
        if rtt_s < 0:
            raise ValueError(f"an RTT sample cannot be negative ({rtt_s})")
        self.srtt = rtt_s if self.srtt is None else self.srtt + SRTT_GAIN * (rtt_s - self.srtt)
        while self._mins and self._mins[-1][1] >= rtt_s:
            self._mins.pop()
        self._mins.append((now, rtt_s))

    def minimum(self, now: float) -> float | None:
        """The least sample of the window; the latest sample if none is that recent."""
        while len(self._mins) > 1 and self._mins[0][0] < now - self.min_window_s:
            self._mins.popleft()
        return self._mins[0][1] if self._mins else None


@dataclass
class LinkMeter:
    """One directed link as one end sees it. Every method takes the caller's ``now``."""

    window_s: float = 10.0
    rtt_min_window_s: float = 60.0
    created: float = 0.0
    goodput: Goodput = field(init=False)
    rtt: RttEstimator = field(init=False)
    queued: int = 0
    in_flight: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    timeouts: int = 0
    channels: int = 0  # channels feeding it now (attach/detach)
    last_active: float = field(init=False)

    def __post_init__(self) -> None:
        self.goodput = Goodput(self.window_s, self.created)
        self.rtt = RttEstimator(self.rtt_min_window_s)
        self.last_active = self.created

    # --- channels ---------------------------------------------------------------------------
    def attach(self) -> None:
        """A channel feeds the link from now on (a link in use never expires)."""
        self.channels += 1

    def detach(self, now: float) -> None:
        """A channel that fed the link ended."""
        self.channels -= 1
        self.last_active = now

    # --- the sending end ------------------------------------------------------------------
    def commit(self, nbytes: int, now: float) -> None:
        """A transfer promised ``nbytes`` to the link (its backlog) before sending them."""
        self.queued += nbytes
        self.last_active = now

    def record_sent(self, nbytes: int, now: float, from_queue: int = 0) -> None:
        """``nbytes`` left for the peer, ``from_queue`` of them out of the committed backlog."""
        self.queued -= from_queue
        self.in_flight += nbytes
        self.last_active = now

    def record_acked(self, nbytes: int, now: float) -> None:
        """The receiver confirmed ``nbytes`` (flow-control credit): delivered."""
        self.in_flight -= nbytes
        self.goodput.add(nbytes, now)
        self.last_active = now

    def release(self, queued: int, in_flight: int, now: float) -> None:
        """A channel ended with this backlog unsent and these bytes never confirmed."""
        self.queued -= queued
        self.in_flight -= in_flight
        self.last_active = now

    # --- the receiving end ----------------------------------------------------------------
    def record_received(self, nbytes: int, now: float) -> None:
        """``nbytes`` arrived from the peer: delivered."""
        self.goodput.add(nbytes, now)
        self.last_active = now

    # --- either end -----------------------------------------------------------------------
    def record_rtt(self, rtt_s: float, now: float) -> None:
        self.rtt.add(rtt_s, now)
        self.last_active = now

    def record_failure(self, reason: str, now: float) -> None:
        self.failures[reason] = self.failures.get(reason, 0) + 1
        self.last_active = now

    def record_timeout(self, now: float) -> None:
        self.timeouts += 1
        self.last_active = now

    def snapshot(self, now: float) -> LinkSnapshot:
        return LinkSnapshot(
            goodput_bps=self.goodput.rate(now),
            rtt_s=self.rtt.srtt,
            rtt_min_s=self.rtt.minimum(now),
            queued_bytes=self.queued,
            in_flight_bytes=self.in_flight,
            failures=dict(self.failures),
            timeouts=self.timeouts,
        )

    def idle_since(self, now: float) -> float | None:
        """Seconds without a channel, a backlog or an event; None while the link is in use."""
        if self.channels or self.queued or self.in_flight:
            return None
        return now - self.last_active


class LinkMeters:
    """Every link one instance measures. A link idle for ``expire_after_s`` is forgotten, so
    the exported series are bounded by the peers talked to lately: a peer that is gone
    (scaled down, restarted under a new name) leaves within that time."""

    def __init__(
        self, window_s: float = 10.0, rtt_min_window_s: float = 60.0, expire_after_s: float = 300.0
    ) -> None:
        if expire_after_s < window_s:
            raise ValueError("expire_after_s must be at least window_s (goodput must decay first)")
        self.window_s = window_s
        self.rtt_min_window_s = rtt_min_window_s
        self.expire_after_s = expire_after_s
        self._links: dict[LinkKey, LinkMeter] = {}

    def meter(self, key: LinkKey, now: float) -> LinkMeter:
        """The link's meter, created on first use."""
        meter = self._links.get(key)
        if meter is None:
            meter = LinkMeter(self.window_s, self.rtt_min_window_s, created=now)
            self._links[key] = meter
        return meter

    def snapshots(self, now: float) -> list[tuple[LinkKey, LinkSnapshot]]:
        """Each live link's snapshot, after forgetting the expired ones."""
        for key in [k for k, m in self._links.items() if self._expired(m, now)]:
            del self._links[key]
        return [(key, meter.snapshot(now)) for key, meter in self._links.items()]

    def _expired(self, meter: LinkMeter, now: float) -> bool:
        idle = meter.idle_since(now)
        return idle is not None and idle >= self.expire_after_s
