"""The network: one shared WAN line between the datacenters, and the in-datacenter fabric.

The WAN line is one bottleneck shared fairly by every transfer in flight (processor
sharing: n concurrent flows each get 1/n of the bandwidth, as long-lived TCP flows
roughly do), plus one RTT and a random jitter per transfer. It is simulated
analytically: a *virtual clock* counts the bytes each active flow has received, so
only arrivals and completions are events, never individual packets.

The in-datacenter fabric (RDMA between P and RLD, or P and D in the same-datacenter
baseline) is a per-NIC path with its own bandwidth and latency and no cross-flow
contention, since each node has its own NIC on a non-blocking fabric.
"""

from __future__ import annotations

import heapq
import itertools
import random

import simpy

from pdd.simulator.events import Alarm, succeed_after

_GIGA = 1e9


class SharedLink:
    """A bottleneck of ``gbps`` shared by all flows, ``rtt_ms`` and ``jitter_ms`` on top."""

    def __init__(
        self, env: simpy.Environment, gbps: float, rtt_ms: float, jitter_ms: float, seed: int
    ) -> None:
        if gbps <= 0 or rtt_ms < 0 or jitter_ms < 0:
            raise ValueError("link gbps must be > 0 and rtt_ms, jitter_ms >= 0")
        self.env = env
        self.bytes_per_s = gbps * _GIGA / 8
        self.rtt_s = rtt_ms / 1000
        self.jitter_s = jitter_ms / 1000
        self._rng = random.Random(seed)
        # (finish on the virtual clock, arrival order, the transfer's event, its latency)
        self._flows: list[tuple[float, int, simpy.Event, float]] = []
        self._seq = itertools.count()
        self._virtual = 0.0  # bytes each active flow has received since the epoch
        self._last = 0.0
        self._alarm = Alarm(env, self._on_timer)
        self.bytes_sent = 0.0
        self.busy_s = 0.0  # time with at least one flow in flight (the line is full then)

    def transfer(self, nbytes: float) -> simpy.Event:
        """An event that fires when ``nbytes`` have crossed and the last byte has landed."""
        done = self.env.event()
        jitter = abs(self._rng.gauss(0.0, self.jitter_s)) if self.jitter_s else 0.0
        latency = self.rtt_s + jitter
        self.bytes_sent += nbytes
        if nbytes <= 0:
            succeed_after(self.env, done, latency)
            return done
        self._advance()
        heapq.heappush(self._flows, (self._virtual + nbytes, next(self._seq), done, latency))
        self._reschedule()
        return done

    def busy_until_now(self) -> float:
        """Seconds with data in flight up to now (counts the current segment)."""
        self._advance()
        return self.busy_s

    @property
    def active_flows(self) -> int:
        return len(self._flows)

    def _advance(self) -> None:
        now = self.env.now
        n = len(self._flows)
        if n:
            self._virtual += (now - self._last) * self.bytes_per_s / n
            self.busy_s += now - self._last
        self._last = now

    def _reschedule(self) -> None:
        if not self._flows:
            self._alarm.clear()
            return
        wait = max(0.0, (self._flows[0][0] - self._virtual) * len(self._flows) / self.bytes_per_s)
        self._alarm.set(wait)

    def _on_timer(self) -> None:
        self._advance()
        # Tolerate float round-off: a flow within a byte of its finish is done.
        while self._flows and self._flows[0][0] <= self._virtual + 1.0:
            _, _, done, latency = heapq.heappop(self._flows)
            succeed_after(self.env, done, latency)
        self._reschedule()


class DirectLink:
    """In-datacenter RDMA: ``gbps`` per transfer, ``latency_ms``, no contention."""

    def __init__(self, env: simpy.Environment, gbps: float, latency_ms: float) -> None:
        if gbps <= 0 or latency_ms < 0:
            raise ValueError("in-datacenter gbps must be > 0 and latency_ms >= 0")
        self.env = env
        self.bytes_per_s = gbps * _GIGA / 8
        self.latency_s = latency_ms / 1000
        self.bytes_sent = 0.0

    def transfer(self, nbytes: float) -> simpy.Event:
        self.bytes_sent += nbytes
        return self.env.timeout(self.latency_s + max(0.0, nbytes) / self.bytes_per_s)
