"""A client that goes away while its answer is being made cancels the making of it.

A stream notices on its own: Starlette listens for ``http.disconnect`` while it sends,
and the body's close cancels the request on the workers. A non-streaming response
sends nothing until the whole answer is ready, so nothing listened: a client that gave
up after a second had its 2,000-token answer generated to the end, for nobody, and
logged as 200. ``unless_disconnected`` runs the work beside a listener on the ASGI
receive channel (vLLM's ``with_cancellation`` does the same) and, once the client has
gone, cancels the work and raises ``ClientDisconnect``: the cancel closes the
request's streams, which cancels it on every worker it touched (``stream_relay``), so
their blocks and the router's leases are freed at once; the app logs it as 499.

The work is cancelled through an anyio cancel scope, not ``Task.cancel()``: httpx
closes its responses under anyio shields, which only anyio's cancellation respects
(``stoppable``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

import anyio
from starlette.requests import ClientDisconnect
from starlette.types import Receive

T = TypeVar("T")


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """``work``'s result; ``ClientDisconnect`` (``work`` cancelled) if the client goes
    away first. Call it once the request's body has been read: the listener takes
    every message that arrives after it."""
    with anyio.CancelScope() as scope:
        listener = asyncio.create_task(_cancel_on_disconnect(receive, scope))
        try:
            result = await work
        finally:
            listener.cancel()  # it only ever waits on ``receive``: a plain cancel is safe
    if scope.cancel_called:  # whether or not the work got to its end: nobody reads it
        raise ClientDisconnect("the client closed the connection before the response")
    return result


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()
