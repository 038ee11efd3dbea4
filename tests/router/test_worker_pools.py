"""The router keeps a connection pool per worker, and closes it when the worker leaves.

httpcore walked every connection of a pool (``has_expired``, ``is_idle``: a syscall or two
each) on every request and every response's close. With one pool for the whole fleet each
call to a worker paid for every other worker's idle connections, so the router's CPU per
request grew with the fleet (docs/router-scale.md). The router's own transport
(``pdd.router.worker_http``) checks the idle connections it takes, of that worker only.
With a pool per worker, a worker that leaves the fleet needs its pool closed: nothing
takes from it again, so its expired connections would never be closed. Here real
``WorkerClient`` s talk over real TCP to keep-alive workers on loopback that count their
open connections.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from pdd.common.vocabulary import Role
from pdd.common.wire import LoadReport
from pdd.router import worker_http
from pdd.router.config import WorkerRef
from pdd.router.prefix_index import PrefixIndex, PrefixIndexConfig
from pdd.router.registry import InstanceRegistry
from pdd.router.worker_client import WorkerClient
from pdd.testing.loopback_server import LoopbackServer
from pdd.testing.waiting import until

pytestmark = pytest.mark.integration

WORKERS = 12
#: A worker's stream is held open until released: a call in flight when its worker leaves.
HELD = "/v1/pdd/requests/held/stream"


class KeepAliveWorker(LoopbackServer):
    """An HTTP/1.1 server on loopback answering ``/load`` (and an empty page of cache
    events; ``/health``: not ready) on keep-alive connections, counting how many are open
    now."""

    def __init__(self) -> None:
        super().__init__()
        self.open = 0
        self.release = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1].decode()
                if path == HELD:
                    await self.release.wait()
                writer.write(_answer(path, self.port))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open -= 1
            writer.close()


def _answer(path: str, port: int) -> bytes:
    if path.startswith("/load"):
        body = LoadReport(
            instance_id=f"w{port}", role=Role.MAIN, running=0, waiting=0, kv_blocks_free=1,
            kv_blocks_total=1, relay_load=0.0, capacity=1,
        ).model_dump_json().encode()  # fmt: skip
    elif path.startswith("/v1/pdd/cache-events"):
        body = b'{"instance_id": "w", "next_cursor": 0, "events": []}'
    elif path == "/health":  # still starting: the poll fails, the connection stays open
        return b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n"
    else:
        body = b""
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


async def _workers(n: int) -> list[KeepAliveWorker]:
    workers = [KeepAliveWorker() for _ in range(n)]
    for w in workers:
        await w.start()
    return workers


async def test_a_call_checks_no_more_connections_when_the_fleet_grows(monkeypatch) -> None:
    checked = 0
    usable = worker_http._Connection.usable

    def counting(self: worker_http._Connection, now: float, expiry_s: float) -> bool:
        nonlocal checked
        checked += 1
        return usable(self, now, expiry_s)

    monkeypatch.setattr(worker_http._Connection, "usable", counting)
    workers = await _workers(WORKERS)
    client = WorkerClient("secret")
    try:
        await client.load(workers[0].url)
        checked = 0
        await client.load(workers[0].url)  # one worker in the fleet, one pooled connection
        alone = checked
        for w in workers[1:]:  # every other worker now holds an idle pooled connection too
            await client.load(w.url)
        checked = 0
        await client.load(workers[0].url)
        assert checked == alone == 1, (
            f"a call to one worker checked {checked} pooled connections with {WORKERS} "
            f"workers in the fleet, {alone} with one"
        )
    finally:
        await client.aclose()
        for w in workers:
            await w.stop()


async def test_a_worker_that_leaves_the_fleet_has_its_connections_closed(monkeypatch) -> None:
    stays, leaves = await _workers(2)
    client = WorkerClient("secret")
    loop = asyncio.get_running_loop()
    resolved = {"stays": True, "leaves": True}

    async def getaddrinfo(host: str, port: int, **kwargs: object) -> list:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))][: resolved[host]]

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
    refs = tuple(
        WorkerRef(role=Role.MAIN, http_url="", dns_host=host, http_port=w.port)
        for host, w in (("stays", stays), ("leaves", leaves))
    )
    registry = InstanceRegistry(refs, client, PrefixIndex(PrefixIndexConfig(16)), 1.0)
    try:
        await registry.poll_once()
        assert stays.open == 1 and leaves.open == 1  # each polled on a kept-alive connection
        resolved["leaves"] = False  # the pod is gone from its Service
        await registry.poll_once()
        await until(lambda: leaves.open == 0, "the connection to the worker that left closed")
        assert stays.open == 1
    finally:
        await client.aclose()
        await stays.stop()
        await leaves.stop()


async def test_a_call_in_flight_when_its_worker_leaves_ends_before_its_pool_closes() -> None:
    (worker,) = await _workers(1)
    client = WorkerClient("secret")
    try:
        stream = client.stream(worker.url, "held")
        reading = asyncio.ensure_future(anext(stream, None))
        await until(lambda: worker.open == 1, "the stream's connection open")
        await client.forget(worker.url)
        assert worker.open == 1 and not reading.done()  # still being served
        worker.release.set()
        assert await reading is None  # the stream ended on its own, not cut
        await until(lambda: worker.open == 0, "the pool closed once its last call ended")
    finally:
        await client.aclose()
        await worker.stop()
