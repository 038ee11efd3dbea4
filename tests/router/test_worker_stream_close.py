"""A worker stream the router stops reading, at whatever point, leaves no socket open.

The router reads each decode source's stream on a task of its own and stops those
tasks when the request ends. httpx closes a finished response inside cancel-shielded
scopes (anyio's): a stop that landed there as a bare ``Task.cancel()`` interrupted the
close half-way, and the pooled connection stayed "active" with its socket open for
good (the router's open fds grew 10 -> 109 over a 30-minute soak). Here a real
``WorkerClient`` reads over real TCP from a scripted worker that streams a request's
tokens, holds the end of the body until the router has the last token, then ends it
and closes; the request is closed after 0, 1, 2, ... turns of the event loop, so one
of them lands while httpx is closing the response. After each, every socket the router
side opened must be closed (the worker closed its end: a leaked one sits in CLOSE_WAIT).
"""

from __future__ import annotations

import asyncio
import os

import pytest

from pdd.common.wire import Endpoint, PipelinePlan, TokenEvent
from pdd.router.stream_relay import relay_tokens
from pdd.router.worker_client import WorkerClient
from pdd.testing.loopback_server import LoopbackServer
from pdd.testing.waiting import until

pytestmark = pytest.mark.integration

TOKENS = 3
#: Loop turns between the end of the body going out and the request being closed: the
#: close of the response takes a few, so a sweep this wide lands in it on any machine
#: (everything runs on one loop; the count does not depend on speed).
SWEEP = 24


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


class ScriptedWorker(LoopbackServer):
    """An HTTP/1.1 server on loopback: 202 for a plan, and for a stream ``TOKENS`` token
    lines at once, then the end of the body once ``release`` is set; it closes every
    connection after one response, so a socket still open afterwards is a leak."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            method, path = head.split(b" ", 2)[:2]
            length = next(
                (int(line.split(b":")[1]) for line in head.split(b"\r\n")
                 if line.lower().startswith(b"content-length:")),
                0,
            )  # fmt: skip
            await reader.readexactly(length)
            if method == b"POST":
                writer.write(
                    b"HTTP/1.1 202 Accepted\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                )
                await writer.drain()
                return
            request_id = path.decode().split("/")[4]
            lines = b"".join(_chunk(_line(request_id, seq)) for seq in range(TOKENS))
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\n"
                b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n" + lines
            )
            await writer.drain()
            await self.release.wait()
            self.release.clear()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def _line(request_id: str, seq: int) -> bytes:
    last = seq == TOKENS - 1
    event = TokenEvent(
        request_id=request_id, seq=seq, token_id=7, source="md", finished=last,
        finish_reason="length" if last else None,
    )  # fmt: skip
    return event.model_dump_json().encode() + b"\n"


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _plan(worker: ScriptedWorker, n: int) -> PipelinePlan:
    md = Endpoint(instance_id="md", http_url=worker.url, fast_addr="h:1", wan_addr="h:2")
    return PipelinePlan(request_id=f"r{n}", prompt_ids=[1, 2, 3], pipeline="mono", main=md)


async def test_a_stream_stopped_at_any_point_of_its_close_leaves_no_socket_open() -> None:
    worker = ScriptedWorker()
    await worker.start()
    client = WorkerClient("secret")
    baseline = _open_fds()
    try:
        for turns in range(SWEEP):
            events = relay_tokens(_plan(worker, turns), client, 30.0)
            got = [await anext(events) for _ in range(TOKENS)]
            assert got[-1].finished
            worker.release.set()  # the end of the body goes out now
            for _ in range(turns):
                await asyncio.sleep(0)
            await events.aclose()  # the request is over: its reader is stopped
            await until(
                lambda: _open_fds() <= baseline,
                f"every socket closed after a stop {turns} loop turns after the body ended "
                f"({_open_fds()} fds open, {baseline} before)",
                timeout_s=30.0,
            )
    finally:
        await client.aclose()
        await worker.stop()
