"""Requests in flight per API key, and the OpenAPI document the fuzzer and clients read."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from pdd.common.vocabulary import Role
from pdd.router.admission import StreamSlots, releasing
from pdd.router.app import create_app
from pdd.router.config import RouterConfig, WorkerRef
from pdd.router.errors import TooManyStreamsError
from pdd.router.runtime import RouterRuntime

pytestmark = pytest.mark.unit


def test_a_key_over_its_limit_gets_a_429_with_retry_after_and_other_keys_do_not() -> None:
    slots = StreamSlots(limit=2, retry_after_s=1.5)
    first, _ = slots.take("a"), slots.take("a")
    with pytest.raises(TooManyStreamsError) as refused:
        slots.take("a")
    assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "2"}
    assert "2 requests in flight" in refused.value.message
    slots.take("b")  # another key has its own slots
    first()
    first()  # a second release of the same slot gives nothing back twice
    assert slots.held("a") == 1
    slots.take("a")
    assert slots.held("a") == 2


def test_no_limit_takes_every_request() -> None:
    slots = StreamSlots(limit=None, retry_after_s=1.0)
    for _ in range(1000):
        slots.take("")
    assert slots.held("") == 1000


async def test_a_stream_gives_its_slot_back_when_it_ends_or_the_client_goes_away() -> None:
    slots = StreamSlots(limit=1, retry_after_s=1.0)

    async def body() -> AsyncIterator[bytes]:
        for chunk in (b"a", b"b", b"c"):
            yield chunk

    done = releasing(body(), slots.take("k"))
    assert [c async for c in done] == [b"a", b"b", b"c"]
    assert slots.held("k") == 0
    gone = releasing(body(), slots.take("k"))
    assert await anext(gone) == b"a"
    assert slots.held("k") == 1
    await gone.aclose()  # the client disconnected mid-stream
    assert slots.held("k") == 0


def test_the_openapi_document_names_each_routes_request_body() -> None:
    ref = WorkerRef(role=Role.MONO, http_url="http://127.0.0.1:1", instance_id="m")
    app = create_app(RouterRuntime(RouterConfig(model="tiny", workers=(ref,), secret="s")))
    doc = app.openapi()
    for path, model in (
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/v1/completions", "CompletionRequest"),
    ):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"] == {"$ref": f"#/components/schemas/{model}"}
    schemas = doc["components"]["schemas"]
    assert "messages" in schemas["ChatCompletionRequest"]["properties"]
    assert "ChatMessage" in schemas  # nested models are components too, refs resolve
    assert "$defs" not in schemas["ChatCompletionRequest"]
