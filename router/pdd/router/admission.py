"""Requests in flight per API key: the router's answer to one client hogging the fleet.

``StreamSlots.take(key)`` counts a request against its key (all clients share one
bucket where no keys are configured) and refuses the one over the limit with a 429
before anything is dispatched; the slot is given back when the response is done,
which for a stream means when its last byte went out or the client went away.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable

from pdd.router.errors import TooManyStreamsError


class StreamSlots:
    def __init__(self, limit: int | None, retry_after_s: float) -> None:
        self._limit = limit
        self._retry_after_s = retry_after_s
        self._held: dict[str, int] = {}

    def held(self, key: str) -> int:
        return self._held.get(key, 0)

    def take(self, key: str) -> Callable[[], None]:
        """One slot of ``key``, or TooManyStreamsError; returns the (idempotent) release."""
        if self._limit is not None and self.held(key) >= self._limit:
            raise TooManyStreamsError(
                f"this API key already has {self._limit} requests in flight (the limit); "
                "retry when one finishes",
                self._retry_after_s,
            )
        self._held[key] = self.held(key) + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._held[key] -= 1
                if not self._held[key]:
                    del self._held[key]

        return release


async def releasing(
    body: AsyncGenerator[bytes, None], release: Callable[[], None]
) -> AsyncGenerator[bytes, None]:
    """``body``, giving the slot back when it ends, fails or is closed (client gone)."""
    try:
        async with contextlib.aclosing(body):
            async for chunk in body:
                yield chunk
    finally:
        release()
