"""The control API says which refusals are for good: a request too large for this
engine whatever its load is ``request_too_large`` (the router's 400, no worker blamed);
any other refusal keeps ``invalid_request`` (the router routes around the worker)."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from pdd.common.wire import REQUEST_TOO_LARGE_ERROR_TYPE, Endpoint, PipelinePlan
from pdd.worker.control_api import create_app
from pdd.worker.engine.request import (
    NoFreeBlocksError,
    PromptTooLongError,
    RequestError,
    RequestTooLargeError,
)

pytestmark = pytest.mark.unit


async def refusal_type(error: RequestError) -> tuple[int, str]:
    async def start_request(_: PipelinePlan) -> None:
        raise error

    role = SimpleNamespace(role="mono", settings=SimpleNamespace(secret="s"))
    role.start_request = start_request
    app = create_app(role, feed=None, ready=lambda: True)  # type: ignore[arg-type]
    main = Endpoint(instance_id="m", http_url="http://m", fast_addr="x:1", wan_addr="x:2")
    plan = PipelinePlan(request_id="r", prompt_ids=[1], pipeline="mono", main=main)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://worker"
    ) as client:
        response = await client.post(
            "/v1/pdd/requests",
            content=plan.model_dump_json(),
            headers={"Authorization": "Bearer s"},
        )
    return response.status_code, response.json()["error"]["type"]


@pytest.mark.parametrize(
    "error",
    [
        RequestTooLargeError("request needs up to 6008 tokens of KV but the pool has 5824"),
        PromptTooLongError("prompt has 9000 tokens; the context window is 8192"),
    ],
)
async def test_a_request_too_large_for_good_is_said_so(error: RequestError) -> None:
    assert await refusal_type(error) == (400, REQUEST_TOO_LARGE_ERROR_TYPE)


@pytest.mark.parametrize(
    "error", [NoFreeBlocksError("no KV blocks right now"), RequestError("a bad id")]
)
async def test_other_refusals_keep_their_type(error: RequestError) -> None:
    assert await refusal_type(error) == (400, "invalid_request")
