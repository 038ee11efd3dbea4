"""Router-wide admission, fair across API keys: a bounded wait in per-key queues, then 429.

Past ``capacity`` requests in flight, a new request waits, in its key's queue, for one
to end; a slot that frees goes to the keys with waiters in turn (round robin), not to
whoever asked first, so a key that sends a hundred requests gets one slot for every
one a key that sends one gets: a noisy key cannot starve a quiet one. The wait is
bounded (``max_wait_s``, a small share of the TTFT budget), and so is the queue
(``max_queued``): past either the request gets a 429 with ``Retry-After`` instead of a
TTFT that grows with the overload, and the requests admitted keep their budget.

Without a capacity (None) every request is admitted here, as before: the policy's own
saturation check (every instance at its reported capacity) still answers 429.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable

from pdd.router.errors import SaturatedError


class OverloadedError(SaturatedError):
    """The router is at its capacity and the request's wait for a slot ran out (or the
    queue is full): retry later."""

    cause = "overloaded"


class FairAdmission:
    def __init__(
        self,
        capacity: int | None,
        max_wait_s: float,
        retry_after_s: float,
        max_queued: int | None = None,
    ) -> None:
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._max_wait_s = max_wait_s
        self._retry_after_s = retry_after_s
        self._max_queued = max_queued if max_queued is not None else 4 * (capacity or 0)
        self.admitted = 0  # requests holding a slot now
        #: Waiting requests per key, keys in turn order (the next to be served first).
        self._queues: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()
        self.held: dict[str, int] = {}  # slots held per key (what a soak samples)

    @property
    def queued(self) -> int:
        return sum(len(q) for q in self._queues.values())

    async def admit(self, key: str) -> Callable[[], None]:
        """A slot for ``key`` (at once, or after a bounded wait) or OverloadedError;
        returns the slot's (idempotent) release."""
        if self.capacity is None:
            return self._take(key)
        if self.admitted < self.capacity and not self._queues:
            return self._take(key)
        if self.queued >= self._max_queued:
            raise self._refusal(f"{self.queued} requests are already waiting for a slot")
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queues.setdefault(key, deque()).append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self._max_wait_s)
        except BaseException as exc:  # the wait ran out, or the request was cancelled
            if waiter.done() and not waiter.cancelled():  # the slot came as the wait ended
                self._give_back(key)
            else:
                waiter.cancel()
                self._forget(key, waiter)
            if isinstance(exc, TimeoutError):
                raise self._refusal(f"no slot freed within {self._max_wait_s} s") from None
            raise
        return self._release_of(key)

    def _refusal(self, why: str) -> OverloadedError:
        return OverloadedError(
            f"the router is at its capacity of {self.capacity} requests in flight and {why}; "
            "retry later",
            self._retry_after_s,
        )

    def _take(self, key: str) -> Callable[[], None]:
        self.admitted += 1
        self.held[key] = self.held.get(key, 0) + 1
        return self._release_of(key)

    def _release_of(self, key: str) -> Callable[[], None]:
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._give_back(key)

        return release

    def _give_back(self, key: str) -> None:
        """``key`` lets go of a slot: it goes to the next key in turn with a waiter."""
        self.admitted -= 1
        self.held[key] -= 1
        if not self.held[key]:
            del self.held[key]
        while self._queues and self.admitted < (self.capacity or 0):
            turn, queue = next(iter(self._queues.items()))
            waiter = queue.popleft()
            if queue:
                self._queues.move_to_end(turn)  # its next waiter comes after the others'
            else:
                del self._queues[turn]
            if waiter.done():  # it gave up already
                continue
            self.admitted += 1
            self.held[turn] = self.held.get(turn, 0) + 1
            waiter.set_result(None)

    def _forget(self, key: str, waiter: asyncio.Future[None]) -> None:
        queue = self._queues.get(key)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self._queues[key]
