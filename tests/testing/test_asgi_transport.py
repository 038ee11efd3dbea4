"""The in-process HTTP transport: responses stream as the app sends them, disconnects and
crashes reach the other side."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from pdd.testing.asgi import StreamingASGITransport
from pdd.testing.virtual_time import advance

pytestmark = [pytest.mark.unit, pytest.mark.virtual_clock]


def ticker_app(sent: list[int], stopped: asyncio.Event) -> FastAPI:
    app = FastAPI()

    @app.get("/ticks")
    async def ticks(n: int) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            try:
                for i in range(n):
                    sent.append(i)
                    yield f"{i}\n".encode()
                    await advance(1.0)  # a tick of work
            finally:
                stopped.set()

        return StreamingResponse(body(), media_type="text/plain")

    @app.post("/echo")
    async def echo(body: dict) -> dict:
        return {"got": body}

    return app


async def test_each_chunk_arrives_when_sent_and_closing_early_stops_the_app() -> None:
    sent: list[int] = []
    stopped = asyncio.Event()
    transport = StreamingASGITransport({"w1:8000": ticker_app(sent, stopped)})
    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(transport=transport) as http:
        assert (await http.post("http://w1:8000/echo", json={"a": 1})).json() == {"got": {"a": 1}}
        arrivals = []
        async with http.stream("GET", "http://w1:8000/ticks", params={"n": 100}) as resp:
            async for line in resp.aiter_lines():
                arrivals.append((int(line), loop.time() - arrivals[0][1] if arrivals else 0.0))
                if len(arrivals) == 3:
                    break
        await stopped.wait()  # the app saw the client leave
    assert [i for i, _ in arrivals] == [0, 1, 2]
    assert [round(t, 6) for _, t in arrivals[1:]] == [1.0, 2.0]  # streamed, not buffered
    assert len(sent) < 100


async def test_a_crashed_server_breaks_open_streams_and_refuses_new_requests() -> None:
    sent: list[int] = []
    transport = StreamingASGITransport({"w1:8000": ticker_app(sent, asyncio.Event())})
    async with httpx.AsyncClient(transport=transport) as http:
        with pytest.raises(httpx.ReadError):
            async with http.stream("GET", "http://w1:8000/ticks", params={"n": 100}) as resp:
                async for _ in resp.aiter_lines():
                    transport.crash("w1:8000")
        with pytest.raises(httpx.ConnectError):
            await http.get("http://w1:8000/ticks", params={"n": 1})
        with pytest.raises(httpx.ConnectError):
            await http.get("http://nobody:8000/")
    assert len(sent) < 100
