"""A request no worker could ever hold is a 400 naming the limit, never a 429.

Found on ``pdd up`` with SmolLM2 (issue 55): a 6,000-token prompt with ``max_tokens`` 8,
under the advertised 8,191-token context but over the workers' 5,824-token KV pool, got
429 with ``Retry-After: 1`` on an idle server, every time. The workers report their pool
(``EngineInfo.kv_tokens``), so the router refuses such a request before dispatch; a
worker that refuses one anyway says it is for good (``request_too_large``), which is the
client's 400, with no worker suspected and nothing re-dispatched.

The workers are scripted behind an in-process transport (``httpx.MockTransport``): the
router's own registry polls them, its own dispatcher and stream relay send the plan.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest

from pdd.common.vocabulary import Role
from pdd.common.wire import (
    REQUEST_TOO_LARGE_ERROR_TYPE,
    CacheEventsPage,
    Endpoint,
    EngineInfo,
    LoadReport,
    PipelinePlan,
    WorkerHealth,
)
from pdd.router.app import create_app
from pdd.router.config import RouterConfig, WorkerRef
from pdd.router.runtime import RouterRuntime
from pdd.router.worker_client import WorkerClient

pytestmark = pytest.mark.unit

#: What SmolLM2-135M-Instruct's workers reported under ``pdd up``.
KV_TOKENS, MAX_MODEL_LEN = 5824, 8192
PDD = ((Role.PREFILL, "p"), (Role.RELAY, "rld"), (Role.MAIN, "md"))
MONO = ((Role.MONO, "m"),)


@dataclass
class Workers:
    """Scripted workers: what each answers to the router's polls, and the plans it got.
    ``refusal``: the error body every plan is answered with (a 400)."""

    kv_tokens: int = KV_TOKENS
    refusal: dict[str, str] = field(
        default_factory=lambda: {"type": "invalid_request", "message": "scripted refusal"}
    )
    plans: list[PipelinePlan] = field(default_factory=list)

    def handle(self, request: httpx.Request) -> httpx.Response:
        name, path = request.url.host, request.url.path
        role = next(role for role, n in (*PDD, *MONO) if n == name)
        if path == "/health":
            return httpx.Response(200, json=self.health(name, role).model_dump(mode="json"))
        if path == "/load":
            load = LoadReport(
                instance_id=name, role=role, running=0, waiting=0, kv_blocks_free=1,
                kv_blocks_total=1, relay_load=0.0, capacity=8,
            )  # fmt: skip
            return httpx.Response(200, json=load.model_dump(mode="json"))
        if path == "/v1/pdd/cache-events":
            page = CacheEventsPage(instance_id=name, next_cursor=0, events=[])
            return httpx.Response(200, json=page.model_dump(mode="json"))
        if path == "/v1/pdd/requests" and request.method == "POST":
            self.plans.append(PipelinePlan.model_validate_json(request.content))
            return httpx.Response(400, json={"error": self.refusal})
        return httpx.Response(204 if request.method == "PUT" else 200)  # wan-peers, cancel

    def health(self, name: str, role: Role) -> WorkerHealth:
        engine = EngineInfo(
            device="cpu", dtype="float32", block_size=16, kv_blocks=self.kv_tokens // 16,
            kv_tokens=self.kv_tokens, kv_bytes=1, max_running_requests=8,
            max_model_len=MAX_MODEL_LEN, max_prompt_tokens=MAX_MODEL_LEN - 1,
            max_num_batched_tokens=512,
        )  # fmt: skip
        endpoint = Endpoint(
            instance_id=name, http_url=f"http://{name}", fast_addr="x:1", wan_addr="x:2"
        )
        return WorkerHealth(role=role, endpoint=endpoint, engine=engine)


@dataclass
class Router:
    runtime: RouterRuntime
    http: httpx.AsyncClient

    async def complete(self, prompt_tokens: int, **fields: object) -> httpx.Response:
        body = {"model": "tiny", "prompt": [104] * prompt_tokens, **fields}
        return await self.http.post("/v1/completions", json=body)


@pytest.fixture
def workers() -> Workers:
    return Workers()


async def router_over(workers: Workers, topology: tuple[tuple[Role, str], ...]):
    refs = tuple(WorkerRef(role, f"http://{name}", name) for role, name in topology)
    config = RouterConfig(model="tiny", workers=refs, secret="s", poll_interval_s=3600.0)
    client = WorkerClient("s", transport=httpx.MockTransport(workers.handle))
    runtime = RouterRuntime(config, client=client)
    await runtime.registry.poll_once()  # what the router learns at start
    assert runtime.ready()
    transport = httpx.ASGITransport(app=create_app(runtime))
    return Router(runtime, httpx.AsyncClient(transport=transport, base_url="http://router"))


@pytest.fixture
async def pdd_router(workers: Workers) -> AsyncIterator[Router]:
    router = await router_over(workers, PDD)
    async with router.http:
        yield router


async def test_a_prompt_over_the_kv_cache_is_a_400_before_dispatch(pdd_router, workers):
    response = await pdd_router.complete(6000, max_tokens=8)
    assert response.status_code == 400, response.text
    assert "retry-after" not in response.headers
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "prompt"
    assert "6000 tokens" in error["message"] and f"{KV_TOKENS} tokens" in error["message"]
    assert workers.plans == []  # refused before any worker saw it
    rejected = pdd_router.runtime.metrics.rejected.labels("request_too_large")._value.get()
    assert rejected == 1


async def test_max_tokens_over_what_the_kv_cache_leaves_is_a_400_naming_it(pdd_router, workers):
    response = await pdd_router.complete(5000, max_tokens=1000)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "max_tokens"
    assert f"1000 > {KV_TOKENS} - 5000" in error["message"]
    assert workers.plans == []


async def test_the_default_max_tokens_stays_within_the_kv_cache(pdd_router, workers):
    """Without ``max_tokens`` the default (256) would overrun the pool by 232 tokens."""
    await pdd_router.complete(KV_TOKENS - 24)
    assert [plan.sampling.max_tokens for plan in workers.plans[:1]] == [24]


async def test_a_workers_permanent_refusal_is_a_400_that_blames_no_worker() -> None:
    """A worker whose pool is smaller than it said (or a router that could not know):
    its ``request_too_large`` is the client's 400, not a failure to route around."""
    workers = Workers(kv_tokens=MAX_MODEL_LEN)  # the router's own check lets it through
    message = "request needs up to 6008 tokens of KV (376 blocks) but the pool has 364"
    workers.refusal = {"type": REQUEST_TOO_LARGE_ERROR_TYPE, "message": message}
    router = await router_over(workers, MONO)
    async with router.http:
        response = await router.complete(6000, max_tokens=8)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == message
    assert len(workers.plans) == 1  # not re-dispatched
    assert all(i.suspected is None for i in router.runtime.registry.all())


async def test_a_refusal_the_worker_does_not_call_permanent_is_still_routed_around() -> None:
    """Any other refusal blames the worker, as before: it is suspected and avoided."""
    workers = Workers(kv_tokens=MAX_MODEL_LEN)
    router = await router_over(workers, MONO)
    async with router.http:
        response = await router.complete(10, max_tokens=8)
    assert response.status_code != 400
    assert [i.instance_id for i in router.runtime.registry.all() if i.suspected] == ["m"]
