"""A worker that answers its poll late stays routable for a while; one that refuses
the connection is left out at once.

On a loaded machine a prefill worker busy computing answered the router's cache-events
poll after the client's timeout; the router left it out on that one late answer, and as
the only prefill worker it took every request with it: 12 of a bench's first 15 requests
were refused 503 ("no prefill worker is ready") while it caught up. A late answer now
makes the worker a suspect (routable while its role has nobody better) until
``SLOW_POLLS_TO_LEAVE_OUT`` polls in a row time out; a refused connection, an error
status or a bad body still leave it out at the first poll. Here the router's own
registry polls scripted workers over its own client, whose network times out or refuses
on demand.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx
import pytest

from pdd.common.vocabulary import Role
from pdd.common.wire import CacheEventsPage, Endpoint, EngineInfo, LoadReport, WorkerHealth
from pdd.router.config import RouterConfig, WorkerRef
from pdd.router.registry import SLOW_POLLS_TO_LEAVE_OUT
from pdd.router.runtime import RouterRuntime
from pdd.router.worker_client import WorkerClient

pytestmark = pytest.mark.unit


@dataclass
class Workers:
    """Scripted workers; ``slow`` ones time out on their cache-events poll (connected,
    no answer in time), ``down`` ones refuse every connection."""

    roles: dict[str, Role]
    slow: set[str] = field(default_factory=set)
    down: set[str] = field(default_factory=set)

    def handle(self, request: httpx.Request) -> httpx.Response:
        name, path = request.url.host, request.url.path
        if name in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        role = self.roles[name]
        if path == "/health":
            return httpx.Response(200, content=health(name, role).model_dump_json())
        if path == "/load":
            load = LoadReport(
                instance_id=name, role=role, running=0, waiting=0, kv_blocks_free=1,
                kv_blocks_total=1, relay_load=0.0, capacity=8,
            )  # fmt: skip
            return httpx.Response(200, content=load.model_dump_json())
        if path == "/v1/pdd/cache-events":
            if name in self.slow:
                raise httpx.ReadTimeout("timed out", request=request)
            page = CacheEventsPage(instance_id=name, next_cursor=0, events=[])
            return httpx.Response(200, content=page.model_dump_json())
        return httpx.Response(204 if request.method == "PUT" else 200)  # wan-peers


def health(name: str, role: Role) -> WorkerHealth:
    engine = EngineInfo(
        device="cpu", dtype="float32", block_size=16, kv_blocks=256, kv_tokens=4096,
        kv_bytes=1, max_running_requests=8, max_model_len=2048, max_prompt_tokens=2047,
        max_num_batched_tokens=512,
    )  # fmt: skip
    endpoint = Endpoint(instance_id=name, http_url=f"http://{name}", fast_addr="x:1",
                        wan_addr="x:2")  # fmt: skip
    return WorkerHealth(role=role, endpoint=endpoint, engine=engine)


def runtime(workers: Workers) -> RouterRuntime:
    refs = tuple(WorkerRef(role, f"http://{name}", name) for name, role in workers.roles.items())
    config = RouterConfig(model="tiny", workers=refs, secret="s", poll_interval_s=3600.0)
    client = WorkerClient("s", transport=httpx.MockTransport(workers.handle))
    return RouterRuntime(config, client=client)


async def prefill_chosen(rt: RouterRuntime) -> str:
    route = await rt.dispatcher.route(list(range(40)), 8)
    return route.prefill.instance_id


async def test_the_only_prefill_worker_answering_late_keeps_serving_until_it_stays_silent():
    workers = Workers({"p": Role.PREFILL, "md": Role.MAIN})
    rt = runtime(workers)
    try:
        await rt.registry.poll_once()
        assert rt.ready()
        workers.slow = {"p"}
        for _ in range(SLOW_POLLS_TO_LEAVE_OUT - 1):
            await rt.registry.poll_once()
            assert rt.ready()  # no 503 for a worker that is only late
            assert await prefill_chosen(rt) == "p"
        await rt.registry.poll_once()  # silent poll after poll: it is left out
        assert not rt.ready()
        workers.slow = set()
        await rt.registry.poll_once()
        assert rt.ready()
        workers.slow = {"p"}  # the count started again at its good poll
        await rt.registry.poll_once()
        assert rt.ready()
    finally:
        await rt.close()


async def test_a_late_worker_is_avoided_while_its_role_has_a_prompt_one():
    workers = Workers({"p0": Role.PREFILL, "p1": Role.PREFILL, "md": Role.MAIN})
    rt = runtime(workers)
    try:
        await rt.registry.poll_once()
        workers.slow = {"p0"}
        await rt.registry.poll_once()
        assert {await prefill_chosen(rt) for _ in range(8)} == {"p1"}
    finally:
        await rt.close()


async def test_a_refused_connection_leaves_the_worker_out_at_once():
    workers = Workers({"p": Role.PREFILL, "md": Role.MAIN})
    rt = runtime(workers)
    try:
        await rt.registry.poll_once()
        workers.down = {"p"}
        await rt.registry.poll_once()
        assert not rt.ready()
    finally:
        await rt.close()
