"""The router's own HTTP/1.1 transport to a worker (``pdd.router.worker_http``).

It replaced httpx's transport for the worker calls because that one cost about 1 ms of
router CPU per call (docs/router-scale.md). What it must keep doing: one write per
request (head and body together: a ``send`` each, where httpcore made two), keep-alive
connections reused and dropped when expired, closed by the worker or left unread,
chunked token streams however the worker cuts them, and httpx's exceptions, which the
router turns into words and into "late" or "gone". A scripted worker on loopback.
"""

from __future__ import annotations

import asyncio
from asyncio import selector_events

import httpx
import pytest

from pdd.common.wire import TokenEvent
from pdd.router.worker_client import WorkerCallError, WorkerClient
from pdd.testing.loopback_server import LoopbackServer
from pdd.testing.waiting import until

pytestmark = pytest.mark.integration


#: In a scripted answer: the worker closes the connection at this point.
CLOSE = b"<close>"
#: An empty chunked body (a token stream that ends at once).
CHUNKED_END = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


class Worker(LoopbackServer):
    """Answers each request with the next scripted answer (a list of writes, ``CLOSE``
    among them: close the connection there; ``None``: close it instead of answering;
    ``"hang"``: no answer until the worker stops), counting connections."""

    def __init__(self, *answers: list[bytes] | str | None) -> None:
        super().__init__()
        self.answers = list(answers)
        self.connections = 0
        self.requests: list[bytes] = []
        self.stopping = asyncio.Event()

    async def __aenter__(self) -> Worker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stopping.set()
        await self.stop()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = [int(h.split(b":")[1]) for h in head.lower().split(b"\r\n")
                          if h.startswith(b"content-length:")]  # fmt: skip
                self.requests.append(head + await reader.readexactly(sum(length)))
                answer = self.answers.pop(0)
                if answer == "hang":
                    await self.stopping.wait()
                if answer is None or answer == "hang":
                    break
                for part in answer:
                    if part is CLOSE:
                        return
                    writer.write(part)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def _event(seq: int) -> str:
    return TokenEvent(request_id="r1", seq=seq, token_id=7 + seq, source="md").model_dump_json()


def _ok(body: bytes = b"{}") -> list[bytes]:
    return [b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)]


LOAD = (
    b'{"instance_id": "w", "role": "main", "running": 0, "waiting": 0, "kv_blocks_free": 1,'
    b' "kv_blocks_total": 1, "relay_load": 0.0, "capacity": 1}'
)


async def test_a_request_goes_to_the_worker_in_one_write(monkeypatch) -> None:
    writes = []
    write = selector_events._SelectorSocketTransport.write

    def counting(self: selector_events._SelectorSocketTransport, data: bytes) -> None:
        if self.get_extra_info("peername")[1] == worker.port:  # the router's side only
            writes.append(bytes(data))
        write(self, data)

    monkeypatch.setattr(selector_events._SelectorSocketTransport, "write", counting)
    async with Worker([b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"]) as worker:
        client = WorkerClient("secret")
        try:
            await client.handoff(worker.url, "r1", [1, 2, 3])
        finally:
            await client.aclose()
    assert len(writes) == 1, f"the request went out in {len(writes)} writes: {writes}"
    assert writes[0] == worker.requests[0]
    assert writes[0].endswith(b'\r\n\r\n{"token_ids":[1,2,3]}')


async def test_a_call_parses_no_url(monkeypatch) -> None:
    """The worker's address is parsed once, for its pool: an ``httpx.Request`` per call
    parsed the whole URL again (a tenth of a millisecond here, three calls a request)."""
    parsed = 0
    init = httpx.URL.__init__

    def counting(self: httpx.URL, *args: object, **kwargs: object) -> None:
        nonlocal parsed
        parsed += 1
        init(self, *args, **kwargs)  # type: ignore[arg-type]

    async with Worker(_ok(LOAD), _ok(), *[[CHUNKED_END]] * 2) as worker:
        client = WorkerClient("secret")
        try:
            await client.load(worker.url)
            monkeypatch.setattr(httpx.URL, "__init__", counting)
            await client.takeover(worker.url, "r1")
            assert [e async for e in client.stream(worker.url, "r1")] == []
            await client.cancel(worker.url, "r1")
        finally:
            await client.aclose()
    assert parsed == 0


async def test_calls_one_after_another_share_one_connection() -> None:
    async with Worker(_ok(LOAD), _ok(LOAD), _ok(LOAD)) as worker:
        client = WorkerClient("secret")
        try:
            for _ in range(3):
                assert (await client.load(worker.url)).instance_id == "w"
        finally:
            await client.aclose()
    assert worker.connections == 1


async def test_a_chunked_stream_is_read_however_the_worker_cuts_it() -> None:
    lines = [_event(seq).encode() + b"\n" for seq in range(3)]
    body = b"".join(_chunk(line) for line in lines) + b"0\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    cuts = [head + body[:5], body[5:31], body[31:32], body[32:-3], body[-3:]]
    async with Worker(cuts, _ok(LOAD)) as worker:
        client = WorkerClient("secret")
        try:
            events = [e async for e in client.stream(worker.url, "r1")]
            await client.load(worker.url)  # read to its end: the connection is reused
        finally:
            await client.aclose()
    assert [(e.token_id, e.seq) for e in events] == [(7, 0), (8, 1), (9, 2)]
    assert worker.connections == 1


async def test_a_stream_left_before_its_end_takes_its_connection_with_it() -> None:
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    first = head + _chunk(_event(0).encode() + b"\n")
    async with Worker([first], _ok(LOAD)) as worker:
        client = WorkerClient("secret")
        try:
            async for _ in client.stream(worker.url, "r1"):
                break  # the rest of the body is never read: the connection cannot carry more
            await client.load(worker.url)
        finally:
            await client.aclose()
    assert worker.connections == 2


async def test_an_idle_connection_is_not_reused_once_expired(monkeypatch) -> None:
    async with Worker(_ok(LOAD), _ok(LOAD)) as worker:
        client = WorkerClient("secret")
        try:
            await client.load(worker.url)
            monkeypatch.setattr(client._pool(worker.url).http, "_expiry_s", 0.0)
            await client.load(worker.url)
        finally:
            await client.aclose()
    assert worker.connections == 2


async def test_idle_connections_past_their_expiry_are_closed_at_the_next_call() -> None:
    """Under a fresher idle connection too: the pool is taken newest first, and one that
    expired below it was never looked at again, so a burst's connections stayed open
    (the router's fds did not come back after a client churn)."""
    async with Worker(_ok(LOAD), _ok(LOAD), _ok(LOAD)) as worker:
        client = WorkerClient("secret")
        try:
            await asyncio.gather(client.load(worker.url), client.load(worker.url))
            http = client._pool(worker.url).http
            older, newer = http._idle  # type: ignore[attr-defined]
            older.idle_since -= 3600.0  # long expired; the newer one is fresh
            await client.load(worker.url)
            assert older.writer.is_closing()
            assert http._idle == [newer]  # type: ignore[attr-defined]
        finally:
            await client.aclose()
    assert worker.connections == 2


async def test_a_connection_the_worker_closed_while_idle_is_not_reused() -> None:
    async with Worker([*_ok(LOAD), CLOSE], _ok(LOAD)) as worker:
        client = WorkerClient("secret")
        try:
            await client.load(worker.url)
            (idle,) = client._pool(worker.url).http._idle  # type: ignore[attr-defined]
            await until(idle.reader.at_eof, "the router saw the worker close its end")
            await client.load(worker.url)
        finally:
            await client.aclose()
    assert worker.connections == 2


async def test_no_answer_within_the_read_timeout_is_late() -> None:
    async with Worker("hang") as worker:
        client = WorkerClient("secret", timeout_s=0.2)
        try:
            with pytest.raises(WorkerCallError) as failed:
                await client.load(worker.url)
        finally:
            await client.aclose()
    assert failed.value.late
    assert "ReadTimeout" in failed.value.detail


async def test_a_worker_that_is_gone_is_not_late() -> None:
    async with Worker() as worker:
        url = worker.url
    client = WorkerClient("secret")
    try:
        with pytest.raises(WorkerCallError) as failed:
            await client.load(url)
    finally:
        await client.aclose()
    assert not failed.value.late
    assert "ConnectError" in failed.value.detail


async def test_a_worker_that_closes_without_answering_fails_the_call() -> None:
    async with Worker(None) as worker:
        client = WorkerClient("secret")
        try:
            with pytest.raises(WorkerCallError) as failed:
                await client.load(worker.url)
        finally:
            await client.aclose()
    assert "RemoteProtocolError" in failed.value.detail


async def test_an_answer_with_no_body_needs_no_length() -> None:
    async with Worker([b"HTTP/1.1 204 No Content\r\n\r\n"], _ok(LOAD)) as worker:
        client = WorkerClient("secret")
        try:
            await client.warm_wan_peers(worker.url, [])
            await client.load(worker.url)
        finally:
            await client.aclose()
    assert worker.connections == 1


async def test_a_malformed_answer_is_a_protocol_error() -> None:
    answer = [b"HTTP/1.1 200 OK\r\ncontent-length: many\r\n\r\n{}"]
    async with Worker(answer) as worker:
        client = WorkerClient("secret")
        try:
            with pytest.raises(WorkerCallError, match=r"RemoteProtocolError.*Content-Length"):
                await client.load(worker.url)
        finally:
            await client.aclose()


@pytest.mark.parametrize(
    "answer",
    [  # a sized body cut short; a chunked one cut inside a chunk
        [b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{}", CLOSE],
        [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n", b"ff\r\n{}", CLOSE],
    ],
)
async def test_a_worker_that_closes_mid_body_fails_the_call(answer: list[bytes]) -> None:
    async with Worker(answer) as worker:
        client = WorkerClient("secret")
        try:
            with pytest.raises(WorkerCallError, match=r"RemoteProtocolError.*the answer's body"):
                await client.load(worker.url)
        finally:
            await client.aclose()
