"""The WAN link's settings and counters, one type for both of their readers.

``WanLink.stats()`` builds a ``LinkStats`` and the admin endpoint's ``GET /stats`` sends
that same object as JSON, so the in-process view and the answer on the wire cannot
drift apart (issue 57: a fact is written once). It lives apart from ``link`` and
``admin`` so both import it without importing each other. No field takes a non-finite
number: ``Infinity`` is not JSON, and the line's bounds keep every value finite.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class RouteStats(_Answer):
    listen: str
    to: str


class ConnectionStats(_Answer):
    active: int
    total: int
    refused: int
    reset: int


class DirectionStats(_Answer):
    bytes: int
    throughput_gbps: float


class LinkStats(_Answer):
    """``GET /stats`` (and every admin answer), and ``WanLink.stats()``: the line's
    settings and counters, as ``pdd bench`` and the tests read them."""

    listen: str
    to: str
    routes: list[RouteStats]
    gbps: float
    rtt_ms: float
    jitter_ms: float
    cut: bool
    connections: ConnectionStats
    forward: DirectionStats
    reverse: DirectionStats
