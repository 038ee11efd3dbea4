"""An httpx transport that calls ASGI apps in-process and streams their responses.

httpx's own ``ASGITransport`` returns a response only once the app has sent all
of it, which a token stream that stays open for the whole request cannot work
with. This one hands the response back as soon as the app starts it and yields
each body chunk as the app sends it; closing the response early tells the app
the client went away (``http.disconnect``), as a real server would.

Apps are addressed by the URL's ``host:port``, so a client configured with the
workers' real URLs reaches them unchanged; an address with no app is refused
like a closed port (``httpx.ConnectError``). ``crash(address)`` is what a dead
server does to its clients: open responses break (``httpx.ReadError``) and new
requests are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import httpx

Message = MutableMapping[str, Any]
ASGIApp = Callable[
    [Message, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
    Awaitable[None],
]
_END = None


class StreamingASGITransport(httpx.AsyncBaseTransport):
    """Routes each request to ``apps[host:port]``; bodies stream both ways in order."""

    def __init__(self, apps: dict[str, ASGIApp] | None = None) -> None:
        self.apps: dict[str, ASGIApp] = dict(apps or {})
        self._open: dict[str, set[_Exchange]] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        address = f"{request.url.host}:{request.url.port}"
        app = self.apps.get(address)
        if app is None:
            raise httpx.ConnectError(f"nothing serves {address}", request=request)
        exchange = _Exchange(app, _scope(request), await request.aread())
        exchanges = self._open.setdefault(address, set())
        exchanges.add(exchange)
        exchange.on_close = exchanges.discard
        status, headers = await exchange.start()
        return httpx.Response(status, headers=headers, stream=exchange, request=request)

    def crash(self, address: str) -> None:
        """The server at ``address`` died: its open responses break, new requests are refused."""
        self.apps.pop(address, None)
        for exchange in list(self._open.pop(address, ())):
            exchange.break_off(httpx.ReadError(f"connection to {address} was reset"))


def _scope(request: httpx.Request) -> Message:
    url = request.url
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": url.scheme,
        "path": url.path,
        "raw_path": url.raw_path.split(b"?")[0],
        "query_string": url.query,
        "root_path": "",
        "headers": [(k.lower(), v) for k, v in request.headers.raw],
        "server": (url.host, url.port),
        "client": ("127.0.0.1", 0),
    }


class _Exchange(httpx.AsyncByteStream):
    """One request/response: the app runs as a task, its body chunks queue up for the reader."""

    def __init__(self, app: ASGIApp, scope: Message, body: bytes) -> None:
        self._body: bytes | None = body
        self._disconnected = asyncio.Event()
        self._started: asyncio.Future[tuple[int, list[tuple[bytes, bytes]]]]
        self._started = asyncio.get_running_loop().create_future()
        self._chunks: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
        self._task = asyncio.create_task(self._run(app, scope))
        self.on_close: Callable[[_Exchange], None] = lambda exchange: None

    async def start(self) -> tuple[int, list[tuple[bytes, bytes]]]:
        return await self._started

    async def _run(self, app: ASGIApp, scope: Message) -> None:
        try:
            await app(scope, self._receive, self._send)
        except Exception as exc:
            if not self._started.done():
                self._started.set_exception(exc)
            self._chunks.put_nowait(httpx.RemoteProtocolError(f"the app failed: {exc!r}"))
            return
        if not self._started.done():
            self._started.set_exception(httpx.RemoteProtocolError("the app sent no response"))
        self._chunks.put_nowait(_END)

    async def _receive(self) -> Message:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self._disconnected.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self._started.set_result((message["status"], list(message.get("headers", []))))
        elif message["type"] == "http.response.body":
            if message.get("body"):
                self._chunks.put_nowait(message["body"])
            if not message.get("more_body", False):
                self._chunks.put_nowait(_END)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (chunk := await self._chunks.get()) is not _END:
            if isinstance(chunk, BaseException):
                raise chunk
            yield chunk

    def break_off(self, error: httpx.TransportError) -> None:
        """The server is gone: the reader gets ``error`` next, the app is cancelled."""
        if not self._started.done():
            self._started.set_exception(error)
        self._chunks.put_nowait(error)
        self._task.cancel()

    async def aclose(self) -> None:
        """The client is done (or gone): the app sees a disconnect and is given up on."""
        self.on_close(self)
        self._disconnected.set()
        if not self._task.done():
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
