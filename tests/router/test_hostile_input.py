"""Hostile but honest input gets a clear 4xx, never a 500 and never a silent reading.

Each case was found probing ``pdd up`` (issue 55): content parts, lone surrogates, deeply
nested JSON, template-owned ``chat_template_kwargs``, ``true`` for an integer, an empty
stop string, a body that is not declared as JSON, a loosely spelled API key. The app is
the real one, reached in process (no socket); no worker is up, so a request that passes
every check gets as far as routing (a 503): that is how "accepted" reads here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdd.common.vocabulary import Role
from pdd.router.app import create_app
from pdd.router.chat_template import RESERVED_KWARGS
from pdd.router.config import RouterConfig, WorkerRef
from pdd.router.openai_protocol import ChatCompletionRequest
from pdd.router.request_body import MAX_JSON_DEPTH
from pdd.router.runtime import RouterRuntime
from pdd.router.serving_chat import OpenAIServingChat

pytestmark = pytest.mark.unit

#: SmolLM2-135M-Instruct's template, as ``pdd up`` serves it (its ChatML concatenates
#: ``message['content']`` as a string), plus a variable a request may set.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if date_string is defined %}{{ 'Today: ' + date_string }}{% endif %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
KEY = "k-1"
AUTH = {"Authorization": f"Bearer {KEY}"}
ACCEPTED = 503  # past every check: no worker is ready


def runtime_for(model: str) -> RouterRuntime:
    ref = WorkerRef(role=Role.MONO, http_url="http://127.0.0.1:1", instance_id="m")
    config = RouterConfig(
        model=model, workers=(ref,), secret="s", api_keys=(KEY,), kv_bytes_per_token=2048
    )
    return RouterRuntime(config)


@pytest.fixture
def templated_model(write_checkpoint) -> Path:
    return write_checkpoint(SMOLLM2_TEMPLATE, None, "<|im_end|>")


@pytest.fixture
async def client(templated_model: Path) -> AsyncIterator[httpx.AsyncClient]:
    """The router over a checkpoint with SmolLM2's template; requests carry the key."""
    app = create_app(runtime_for(str(templated_model)))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://router", headers=AUTH) as c:
        yield c


@pytest.fixture
def model(templated_model: Path) -> str:
    return templated_model.name


def chat(model: str, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": messages, **fields}


def error(response: httpx.Response) -> dict[str, Any]:
    return response.json()["error"]


# --- 2. content parts ------------------------------------------------------------------


@pytest.mark.parametrize("role", ["system", "user", "assistant", "tool"])
async def test_text_content_parts_are_served_in_every_role(client, model, role) -> None:
    """``[{"type": "text", ...}]`` content was a 500 (the template concatenated a list)."""
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    message: dict[str, Any] = {"role": role, "content": parts}
    if role == "tool":
        message["tool_call_id"] = "call_1"
    messages = [message] if role != "assistant" else [{"role": "user", "content": "q"}, message]
    response = await client.post("/v1/chat/completions", json=chat(model, messages))
    assert response.status_code == ACCEPTED, response.text


def test_text_parts_are_joined_by_newlines_as_vllm_joins_them(templated_model) -> None:
    serving = OpenAIServingChat(runtime_for(str(templated_model)))

    def prompt_ids(content: Any) -> list[int]:
        body = chat(templated_model.name, [{"role": "user", "content": content}])
        return serving._prompt_ids(ChatCompletionRequest.model_validate(body))

    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    assert prompt_ids(parts) == prompt_ids("Hi\nthere")


@pytest.mark.parametrize(
    ("part", "words"),
    [
        ({"type": "image_url", "image_url": {"url": "https://x/cat.png"}}, "images are not"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio is"),
        ({"type": "video_url", "video_url": {"url": "https://x/v.mp4"}}, "video is not"),
        ({"type": "hologram", "text": "x"}, "'hologram' is not supported"),
        ({"type": "text"}, "needs 'text'"),
    ],
)
@pytest.mark.parametrize("role", ["system", "user", "assistant", "tool"])
async def test_a_part_that_is_not_text_is_a_400_saying_so(client, model, role, part, words):
    content = [{"type": "text", "text": "look:"}, part]
    body = chat(model, [{"role": role, "content": content, "tool_call_id": "c"}])
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert words in error(response)["message"]
    assert error(response)["param"] == "messages.0.content"


# --- 3. lone surrogates ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            b'{"model": "M", "messages": [{"role": "user", "content": "hi \\ud800"}]}',
            "messages.0.content",
        ),
        ("/v1/completions", b'{"model": "M", "prompt": "\\udc00 there"}', "prompt"),
        ("/v1/completions", b'{"model": "M", "prompt": "p", "stop": ["\\ud800"]}', "stop.0"),
    ],
)
async def test_a_lone_surrogate_is_a_400_naming_where(client, model, path, body, param):
    """A JSON escape that is no character has no UTF-8 form for the tokenizer (was a 500)."""
    response = await client.post(path, content=body.replace(b'"M"', f'"{model}"'.encode()))
    assert response.status_code == 400
    assert error(response)["param"] == param
    assert "lone surrogate" in error(response)["message"]


async def test_a_lone_surrogate_in_a_key_is_a_400_whose_error_can_be_sent(client, model):
    """The key is echoed in ``param``: the error itself held the surrogate and failed to
    encode (a 500), found by tests/router/test_hostile_fuzz.py."""
    body = f'{{"model": "{model}", "prompt": "hi", "\\ud800": null}}'.encode()
    response = await client.post("/v1/completions", content=body)
    assert response.status_code == 400
    assert error(response)["param"] == "\\ud800"  # the escape, as text


async def test_a_surrogate_pair_is_one_character_and_is_served(client, model) -> None:
    body = f'{{"model": "{model}", "prompt": "smile \\ud83d\\ude00"}}'.encode()
    assert (await client.post("/v1/completions", content=body)).status_code == ACCEPTED


# --- 4. nesting ------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 900, 100_000])
async def test_json_nested_too_deep_is_a_400(client, depth) -> None:
    """100,000 levels was a RecursionError (a 500); 900 passes the decoder but not the bound."""
    body = b"[" * depth + b"]" * depth
    response = await client.post("/v1/completions", content=body)
    assert response.status_code == 400
    assert f"nested more than {MAX_JSON_DEPTH} levels" in error(response)["message"]


async def test_nesting_within_the_bound_is_accepted(client, model) -> None:
    nested: Any = "leaf"
    for _ in range(MAX_JSON_DEPTH - 3):  # the body, chat_template_kwargs, its key's value
        nested = [nested]
    body = chat(model, [{"role": "user", "content": "hi"}], chat_template_kwargs={"x": nested})
    assert (await client.post("/v1/chat/completions", json=body)).status_code == ACCEPTED


# --- 5. chat_template_kwargs -----------------------------------------------------------


@pytest.mark.parametrize(
    "key", ["messages", "tools", "documents", "add_generation_prompt", "raise_exception", "range"]
)
async def test_a_kwarg_the_router_sets_is_a_400_naming_it(client, model, key) -> None:
    """``messages`` collided with the router's own argument (a TypeError, a 500); a
    function's name would shadow it in every template that calls it."""
    assert key in RESERVED_KWARGS
    body = chat(model, [{"role": "user", "content": "hi"}], chat_template_kwargs={key: 1})
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert error(response)["param"] == f"chat_template_kwargs.{key}"
    assert repr(key) in error(response)["message"]


async def test_a_kwarg_the_template_cannot_take_is_a_400(client, model) -> None:
    """The template adds ``date_string`` to a text; an integer there was a TypeError."""
    body = chat(model, [{"role": "user", "content": "hi"}], chat_template_kwargs={"date_string": 5})
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert "TypeError" in error(response)["message"]


async def test_special_tokens_and_template_variables_may_still_be_set(client, model) -> None:
    kwargs = {"date_string": "1 May", "bos_token": "<s>", "enable_thinking": False}
    body = chat(model, [{"role": "user", "content": "hi"}], chat_template_kwargs=kwargs)
    assert (await client.post("/v1/chat/completions", json=body)).status_code == ACCEPTED


# --- 6. strict numbers, empty stop strings, the content type ---------------------------

CHAT_INTS = ["max_tokens", "max_completion_tokens", "n", "top_k", "seed", "min_tokens"]
COMPLETION_INTS = ["max_tokens", "n", "top_k", "seed", "min_tokens", "logprobs"]


def chat_body(model: str, **fields: Any) -> dict[str, Any]:
    return chat(model, [{"role": "user", "content": "hi"}], **fields)


def completion_body(model: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "prompt": "hi", **fields}


BODIES: list[tuple[str, Callable[..., dict[str, Any]], str, Any]] = [
    *[("/v1/chat/completions", chat_body, f, v) for f in CHAT_INTS for v in (True, "2", 2.0)],
    *[("/v1/completions", completion_body, f, v) for f in COMPLETION_INTS for v in (True, "2")],
    ("/v1/chat/completions", chat_body, "stream", 1),
    ("/v1/chat/completions", chat_body, "logprobs", 1),
    ("/v1/chat/completions", chat_body, "temperature", True),
    ("/v1/completions", completion_body, "prompt", [104, True]),
    ("/v1/completions", completion_body, "stop_token_ids", [False]),
]


@pytest.mark.parametrize(("path", "make", "field", "value"), BODIES)
async def test_a_number_or_flag_of_another_type_is_a_400(client, model, path, make, field, value):
    """``max_tokens: true`` was read as 1; the OpenAI API refuses it."""
    response = await client.post(path, json=make(model, **{field: value}))
    assert response.status_code == 400, (field, value)
    assert error(response)["param"].split(".")[0] == field


async def test_top_logprobs_true_is_a_400(client, model) -> None:
    body = chat_body(model, logprobs=True, top_logprobs=True)
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert error(response)["param"] == "top_logprobs"


@pytest.mark.parametrize("stop", ["", [""], ["END", ""]])
@pytest.mark.parametrize("make", [chat_body, completion_body])
async def test_an_empty_stop_string_is_a_400(client, model, make, stop) -> None:
    path = "/v1/chat/completions" if make is chat_body else "/v1/completions"
    response = await client.post(path, json=make(model, stop=stop))
    assert response.status_code == 400
    assert error(response)["param"] == "stop"
    assert "must not be empty" in error(response)["message"]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
async def test_a_body_not_declared_as_json_is_a_415(client, model, content_type) -> None:
    body = httpx.Request("POST", "/", json=completion_body(model)).content
    headers = {"Content-Type": content_type}
    response = await client.post("/v1/completions", content=body, headers=headers)
    assert response.status_code == 415
    assert error(response)["type"] == "invalid_request_error"
    assert content_type in error(response)["message"]


@pytest.mark.parametrize(
    "content_type", ["application/json", "Application/JSON; charset=utf-8", "application/x+json"]
)
async def test_json_content_types_and_none_are_accepted(client, model, content_type) -> None:
    body = httpx.Request("POST", "/", json=completion_body(model)).content
    declared = await client.post(
        "/v1/completions", content=body, headers={"Content-Type": content_type}
    )
    assert declared.status_code == ACCEPTED
    undeclared = await client.post("/v1/completions", content=body)  # httpx sends none
    assert "content-type" not in undeclared.request.headers
    assert undeclared.status_code == ACCEPTED


# --- 7. the API key --------------------------------------------------------------------


@pytest.mark.parametrize(
    "header", [f"bearer {KEY}", f"BEARER {KEY}", f"Bearer  {KEY}", f"Bearer {KEY} ", KEY, ""]
)
async def test_only_the_exact_bearer_header_is_accepted(client, model, header) -> None:
    """vLLM compares the whole header with ``Bearer <key>``; so does the router. (A
    trailing space sent on the wire is stripped by the HTTP server before the app
    sees it: it is not part of the header's value.)"""
    response = await client.post(
        "/v1/completions", json=completion_body(model), headers={"Authorization": header}
    )
    assert response.status_code == 401
    assert error(response)["type"] == "authentication_error"


async def test_the_exact_bearer_header_is_accepted(client, model) -> None:
    response = await client.post("/v1/completions", json=completion_body(model), headers=AUTH)
    assert response.status_code == ACCEPTED
