"""bench/stub_worker.py: the worker API the router speaks, with no model behind it.

In-process (unit): its prefix cache and cache-event feed, its load report, and the token
stream a plan gets. Over loopback (integration): the router's own client and stream relay
run requests against a stub process, and a finished request's stream connection goes back
to the router's pool (the stub counts the connections streams were read from).
"""

from __future__ import annotations

import asyncio
import importlib
import socket
import sys
from pathlib import Path

import pytest
import uvicorn

from pdd.common.block_hash import block_hashes
from pdd.common.vocabulary import Role
from pdd.common.wire import BlockStored, Endpoint, PipelinePlan, SamplingSpec
from pdd.router import stream_relay
from pdd.router.stream_relay import relay_tokens
from pdd.router.worker_client import WorkerClient
from pdd.testing.waiting import until

BENCH = Path(__file__).parents[2] / "bench"


def _load(name: str):
    # bench/ scripts import each other as top-level modules, as when run as scripts
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


stub = _load("stub_worker")


def _plan(request_id: str, prompt: list[int], main: Endpoint, max_tokens: int = 4) -> PipelinePlan:
    return PipelinePlan(
        request_id=request_id, prompt_ids=prompt, pipeline="mono", main=main,
        sampling=SamplingSpec(max_tokens=max_tokens),
    )  # fmt: skip


def _instance(role: Role = Role.MONO):
    config = stub.StubConfig(role, "s", token_rate=1e6, block_size=4)
    return stub.StubInstance(config, "m0", 1, client=None)


@pytest.mark.unit
def test_the_cache_counts_held_blocks_and_reports_only_new_ones() -> None:
    cache = stub.PrefixCache(block_size=4)
    first, longer = list(range(9)), list(range(13))
    assert cache.admit(first) == 0  # nothing held; 2 full blocks stored
    assert cache.admit(longer) == 8  # its first 2 blocks held, a third stored
    page = cache.page("m0", 0)
    hashes = block_hashes(longer, 4)
    assert page.events == [
        BlockStored(block_hashes=hashes[:2], parent_hash=None, block_size=4),
        BlockStored(block_hashes=hashes[2:], parent_hash=hashes[1], block_size=4),
    ]
    assert (page.next_cursor, page.reset) == (2, False)
    assert cache.page("m0", 1).events == page.events[1:]
    assert cache.page("m0", 5).reset  # a cursor from another life of the instance


@pytest.mark.unit
def test_an_old_cursor_reads_reset_once_its_events_are_dropped(monkeypatch) -> None:
    monkeypatch.setattr(stub, "EVENTS_KEPT", 2)
    cache = stub.PrefixCache(block_size=1)
    for k in range(3):
        cache.admit([100 + k])
    assert cache.page("m0", 0).reset
    kept = cache.page("m0", 1)
    assert (kept.reset, kept.next_cursor, len(kept.events)) == (False, 3, 2)


@pytest.mark.unit
async def test_a_plan_streams_its_max_tokens_and_its_hit_on_the_first() -> None:
    inst = _instance()
    main = inst.endpoint
    await inst.accept(_plan("a", list(range(8)), main), p_hit=None)
    assert [e.seq for e in [e async for e in inst.events("a")]] == [0, 1, 2, 3]
    stream = inst.events("b")  # the stream opened before the plan came, as the router does
    reader = asyncio.ensure_future(anext(stream))
    await inst.accept(_plan("b", list(range(12)), main, max_tokens=2), p_hit=None)
    first = await reader
    rest = [e async for e in stream]
    assert (first.cached_tokens, first.md_hit_tokens) == (8, 8)
    assert [e.finished for e in (first, *rest)] == [False, True]
    assert rest[-1].finish_reason == "length"
    assert vars(inst.stats) == {
        "requests": 2, "prompt_tokens": 20, "hit_tokens": 8, "tokens_streamed": 6
    }  # fmt: skip
    assert inst.load().running == 0  # both ended


@pytest.mark.unit
def test_the_load_report_counts_requests_with_a_plan() -> None:
    inst = _instance(Role.MAIN)
    assert inst.load().running == 0
    inst._request("waiting-for-its-plan")
    assert inst.load().running == 0
    assert inst.health().engine.block_size == 4
    assert inst.health().role == Role.MAIN


@pytest.fixture
async def held_stub():
    """A stub instance served in this process whose streams hold their ends (the chunk
    that closes the body) until the test sets ``release``: the router has the last token,
    the end is still on the way, as on a busy machine."""
    inst = stub.StubInstance(stub.StubConfig(Role.MONO, "s", token_rate=1e6), "m0", 0, None)
    release = asyncio.Event()
    events = inst.events

    async def held(request_id: str):
        async for event in events(request_id):
            yield event
        await release.wait()
        release.clear()

    inst.events = held
    sock = stub.listen()
    inst.endpoint = inst.endpoint.model_copy(
        update={"http_url": f"http://127.0.0.1:{sock.getsockname()[1]}"}
    )
    server = stub._QuietServer(uvicorn.Config(inst.app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await until(lambda: server.started, "the stub serving")
    yield inst, release
    server.should_exit = True
    await task


@pytest.mark.integration
async def test_finished_requests_reuse_the_router_s_stream_connection(
    held_stub, monkeypatch
) -> None:
    """A reader stopped before its stream's end closes its connection, so the next request
    to that worker paid a new one (across the WAN with TLS: a handshake and a round trip).
    The grace is lifted out of reach here, so only the end's arrival matters."""
    inst, release = held_stub
    monkeypatch.setattr(stream_relay, "STREAM_END_GRACE_S", 600.0, raising=False)
    client = WorkerClient("s")
    try:
        for k in range(4):
            plan = _plan(f"r{k}", list(range(40)), inst.endpoint)
            events = [e async for e in relay_tokens(plan, client, 30.0)]
            assert events[-1].finished and len(events) == 4
            release.set()  # the stream's end goes out after the router had the last token
            await until(lambda: not stream_relay._background, "the request's readers done")
    finally:
        await client.aclose()
    assert (inst.stats.requests, inst.stats.hit_tokens) == (4, 3 * (40 // 16 * 16))
    assert len(inst.stream_peers) == 1  # one connection, reused by every request


@pytest.mark.integration
async def test_the_stub_s_connections_send_small_writes_at_once() -> None:
    """uvicorn writes a response's head and its body separately; where Nagle's algorithm
    is on, the body waits for the client's delayed ACK (40 ms on Linux), so each stub
    answer came 40 ms late and the bench's latencies and connection counts were the
    stub's. asyncio turns Nagle off only on sockets made with protocol ``IPPROTO_TCP``:
    ``listen`` must make its socket so, for the connections it accepts."""
    nodelay: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def accepted(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        nodelay.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    listening = stub.listen()
    server = await asyncio.start_server(accepted, sock=listening)
    try:
        _, writer = await asyncio.open_connection(*listening.getsockname())
        assert await nodelay != 0
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
