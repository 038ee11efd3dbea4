"""Requests cancelled on this instance, remembered a while: a cancel may overtake its request.

The router cancels a request on every instance it touched as soon as the client
goes away, and those cancels race the request's own hops: the plan POSTed to P,
P's ``prepare`` to the relay and to MD. A cancel that arrives first finds nothing to
stop; without a record the request would then arrive and run to its last token (KV
held, a decode slot taken) for a client that is gone. So every cancel is recorded,
and a request that arrives after its cancel is refused. The record is bounded twice:
entries expire after ``ttl_s`` (longer than any hop can lag: the transfer timeout)
and the oldest go first past ``capacity``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

#: At most this many cancels are remembered (one id is ~100 bytes: well under 1 MiB).
CAPACITY = 8192


class RequestCancelledError(Exception):
    """The request was cancelled here before it arrived (HTTP 409)."""


class CancelledRequests:
    def __init__(
        self,
        ttl_s: float,
        capacity: int = CAPACITY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ttl_s = ttl_s
        self._capacity = capacity
        self._clock = clock
        self._at: OrderedDict[str, float] = OrderedDict()

    def add(self, request_id: str) -> None:
        self._expire()
        self._at.pop(request_id, None)
        self._at[request_id] = self._clock()
        while len(self._at) > self._capacity:
            self._at.popitem(last=False)

    def __contains__(self, request_id: object) -> bool:
        self._expire()
        return request_id in self._at

    def __len__(self) -> int:
        self._expire()
        return len(self._at)

    def check(self, request_id: str) -> None:
        """RequestCancelledError if ``request_id`` was cancelled here."""
        if request_id in self:
            raise RequestCancelledError(
                f"request {request_id!r} was cancelled before it reached this instance"
            )

    def _expire(self) -> None:
        cutoff = self._clock() - self._ttl_s
        while self._at and next(iter(self._at.values())) < cutoff:
            self._at.popitem(last=False)
