"""A request no worker could ever hold is a 400 naming the limit, never a 429.

Found on ``pdd up`` with SmolLM2 (issue 55): a 6,000-token prompt with ``max_tokens`` 8,
under the advertised 8,191-token context but over the workers' 5,824-token KV pool, got
429 with ``Retry-After: 1`` on an idle server, every time. The workers report their pool
(``EngineInfo.kv_tokens``), so the router refuses such a request before dispatch; a
worker that refuses one anyway says it is for good (``request_too_large``), which is the
client's 400, with no worker suspected and nothing re-dispatched.

The workers are scripted behind an in-process transport (``pdd.testing.scripted_worker``):
the router's own registry polls them, its own dispatcher and stream relay send the plan.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest

from pdd.common.vocabulary import Role
from pdd.common.wire import REQUEST_TOO_LARGE_ERROR_TYPE, PipelinePlan
from pdd.router.app import create_app
from pdd.router.runtime import RouterRuntime
from pdd.testing.scripted_worker import ScriptedWorkers, engine_info

pytestmark = pytest.mark.unit

#: What SmolLM2-135M-Instruct's workers reported under ``pdd up``.
KV_TOKENS, MAX_MODEL_LEN = 5824, 8192
PDD = ((Role.PREFILL, "p"), (Role.RELAY, "rld"), (Role.MAIN, "md"))
MONO = ((Role.MONO, "m"),)


@dataclass
class Workers(ScriptedWorkers):
    """Scripted workers that keep the plans they get. ``refusal``: the error body every
    plan is answered with (a 400)."""

    refusal: dict[str, str] = field(
        default_factory=lambda: {"type": "invalid_request", "message": "scripted refusal"}
    )
    plans: list[PipelinePlan] = field(default_factory=list)

    def answer_other(self, name: str, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/pdd/requests" and request.method == "POST":
            self.plans.append(PipelinePlan.model_validate_json(request.content))
            return httpx.Response(400, json={"error": self.refusal})
        return super().answer_other(name, request)  # wan-peers, cancel


def scripted(topology: tuple[tuple[Role, str], ...], kv_tokens: int = KV_TOKENS) -> Workers:
    """``topology``'s workers, each with a KV pool of ``kv_tokens``."""
    engine = engine_info(kv_tokens=kv_tokens, max_model_len=MAX_MODEL_LEN)
    return Workers({name: role for role, name in topology}, {name: engine for _, name in topology})


@dataclass
class Router:
    runtime: RouterRuntime
    http: httpx.AsyncClient

    async def complete(self, prompt_tokens: int, **fields: object) -> httpx.Response:
        body = {"model": "tiny", "prompt": [104] * prompt_tokens, **fields}
        return await self.http.post("/v1/completions", json=body)


@pytest.fixture
def workers() -> Workers:
    return scripted(PDD)


async def router_over(workers: Workers) -> Router:
    runtime = workers.router()
    await runtime.registry.poll_once()  # what the router learns at start
    assert runtime.ready()
    transport = httpx.ASGITransport(app=create_app(runtime))
    return Router(runtime, httpx.AsyncClient(transport=transport, base_url="http://router"))


@pytest.fixture
async def pdd_router(workers: Workers) -> AsyncIterator[Router]:
    router = await router_over(workers)
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
    workers = scripted(MONO, kv_tokens=MAX_MODEL_LEN)  # the router's own check lets it through
    message = "request needs up to 6008 tokens of KV (376 blocks) but the pool has 364"
    workers.refusal = {"type": REQUEST_TOO_LARGE_ERROR_TYPE, "message": message}
    router = await router_over(workers)
    async with router.http:
        response = await router.complete(6000, max_tokens=8)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == message
    assert len(workers.plans) == 1  # not re-dispatched
    assert all(i.suspected is None for i in router.runtime.registry.all())


async def test_a_refusal_the_worker_does_not_call_permanent_is_still_routed_around() -> None:
    """Any other refusal blames the worker, as before: it is suspected and avoided."""
    workers = scripted(MONO, kv_tokens=MAX_MODEL_LEN)
    router = await router_over(workers)
    async with router.http:
        response = await router.complete(10, max_tokens=8)
    assert response.status_code != 400
    assert [i.instance_id for i in router.runtime.registry.all() if i.suspected] == ["m"]
