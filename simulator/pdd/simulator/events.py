"""Two event helpers for the analytically simulated resources (decode batches, the WAN line).

Those resources are not stepped token by token or packet by packet: each keeps one
wake-up at the time its next completion is due and recomputes it whenever its state
changes. simpy cannot cancel a scheduled event, so a naive "schedule a new timeout per
change" leaves a stale event on the queue for every change; in a run of the published
scenario more than half of those resources' wake-ups were stale. :class:`Alarm` keeps
at most one live timer that is early or on time, and :func:`succeed_after` triggers an
event after a delay with one queue entry instead of two. Neither changes when anything
happens, only how many events the loop pops to get there.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

import simpy

#: A wake-up this close to its due time rings instead of re-arming: the due time was
#: computed as ``now + delay`` at one instant and the clock reaches it by another sum.
_ON_TIME_S = 1e-9


def succeed_after(env: simpy.Environment, event: simpy.Event, delay: float) -> None:
    """Trigger ``event`` ``delay`` seconds from now: ``Event.succeed`` with a delay, which
    simpy lacks (it is what ``Timeout`` does at creation)."""
    if event.triggered:
        raise RuntimeError(f"{event} has already been triggered")
    event._ok = True
    event._value = None
    env.schedule(event, simpy.events.NORMAL, delay)


class Alarm:
    """Calls ``ring`` once, at the last time :meth:`set` asked for (unless cleared).

    Moving the due time later keeps the timer already queued; when it fires early it
    re-arms for the new time, so a burst of later-moving changes costs one event, not one
    per change. Moving it earlier queues a new timer and leaves the old one to fire
    unheard."""

    def __init__(self, env: simpy.Environment, ring: Callable[[], None]) -> None:
        self._env = env
        self._ring = ring
        self._due = math.inf  # when the owner wants to be called
        self._queued = math.inf  # when the earliest live timer fires
        self._generation = 0  # timers of an older generation fire unheard

    def set(self, delay: float) -> None:
        now = self._env.now
        self._due = now + delay
        if self._due < self._queued:
            self._queue(delay)

    def clear(self) -> None:
        self._due = math.inf

    def _queue(self, delay: float) -> None:
        self._generation += 1
        generation = self._generation
        self._queued = self._env.now + delay
        self._env.timeout(delay).callbacks.append(lambda _: self._fire(generation))

    def _fire(self, generation: int) -> None:
        if generation != self._generation:
            return
        self._queued = math.inf
        now = self._env.now
        if self._due == math.inf:
            return
        if now < self._due - _ON_TIME_S:
            self._queue(self._due - now)
            return
        self._due = math.inf
        self._ring()


def run_until(env: simpy.Environment, until: float) -> None:
    """``env.run(until=until)`` in one loop: the same events in the same order (the stop
    is the same urgent event ``run`` schedules), without a ``step`` call and its exception
    frames per event; a run pops over a hundred thousand events per simulated minute."""
    if until <= env.now:
        raise ValueError(f"until ({until}) must be greater than the current time {env.now}")
    stop = simpy.Event(env)
    stop._ok = True
    stop._value = None
    env.schedule(stop, simpy.events.URGENT, until - env.now)
    queue = env._queue
    while True:
        env._now, _, _, event = heapq.heappop(queue)
        if event is stop:
            return
        # None marks the event processed, as Environment.step does (simpy annotates
        # callbacks as a list and ignores the same line there).
        callbacks, event.callbacks = event.callbacks, None  # type: ignore[assignment]
        for callback in callbacks:
            callback(event)
        if not event._ok and not hasattr(event, "_defused"):
            raise event._value
