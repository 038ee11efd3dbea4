"""No silent ignoring: a request field the router does not implement is a 400 naming it.

The app is the real one, reached in process (httpx's ASGI transport, no socket); no
worker is up, so a request whose fields all pass gets as far as routing (a 503), which
is how the tests tell "accepted" from "refused".
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from pdd.common.vocabulary import Role
from pdd.router.app import create_app
from pdd.router.config import RouterConfig, WorkerRef
from pdd.router.openai_protocol import ChatCompletionRequest, CompletionRequest
from pdd.router.runtime import RouterRuntime

pytestmark = pytest.mark.unit

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "tiny", "prompt": "hi"}
ENDPOINTS = [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    ref = WorkerRef(role=Role.MONO, http_url="http://127.0.0.1:1", instance_id="m")
    app = create_app(RouterRuntime(RouterConfig(model="tiny", workers=(ref,), secret="s")))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
        yield c


@pytest.mark.parametrize(("path", "body"), ENDPOINTS)
@pytest.mark.parametrize("field", ["prediction", "best_of", "functions", "frobnicate"])
async def test_an_unimplemented_field_is_a_400_naming_it(client, path, body, field) -> None:
    response = await client.post(path, json={**body, field: 1})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"] == f"Unrecognized request argument supplied: {field}"
    assert error["param"] == field and error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("path", "body"), ENDPOINTS)
async def test_harmless_client_fields_are_accepted(client, path, body) -> None:
    harmless = {"user": "u-1", "metadata": {"team": "a"}, "store": False, "service_tier": "auto"}
    response = await client.post(path, json={**body, **harmless})
    assert response.status_code == 503  # past validation: no worker is ready


async def test_a_nested_unknown_key_is_named_with_its_path(client) -> None:
    response = await client.post(
        "/v1/chat/completions", json={**CHAT, "stream_options": {"include_usage": True, "x": 1}}
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "stream_options.x"


async def test_messages_keep_their_extra_keys_for_the_template(client) -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [], "refusal": None},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
    ]
    response = await client.post("/v1/chat/completions", json={**CHAT, "messages": messages})
    assert response.status_code == 503


def test_the_schema_documents_the_refusal() -> None:
    """Clients and the fuzzer read additionalProperties: false off the OpenAPI schema."""
    for model in (ChatCompletionRequest, CompletionRequest):
        assert model.model_json_schema()["additionalProperties"] is False
