"""Our wire schemas parse what OpenAI clients send and produce what they parse."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types import Completion
from openai.types.chat import ChatCompletion
from openai.types.chat import ChatCompletionChunk as OpenAIChunk
from pydantic import ValidationError

from pdd.router.openai_protocol import (
    SSE_DONE,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorResponse,
    UsageInfo,
    sse_frame,
)

pytestmark = pytest.mark.unit


def test_chat_request_as_clients_send_it():
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}],
            },
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
        ],
        "max_completion_tokens": 64,
        "max_tokens": 10,
        "stream": True,
        "stream_options": {"include_usage": True},
        "stop": "END",
        "user": "someone",  # unknown to us: accepted and ignored
        "logit_bias": {"1": 2},
    }
    req = ChatCompletionRequest.model_validate(body)
    assert req.output_token_limit == 64  # the newer field wins
    assert req.include_usage_in_stream
    assert req.stop_strings == ["END"]
    assert req.messages[1].text() == "hi \nthere"  # text parts joined as vLLM joins them
    # Extra message keys survive for the chat template.
    assert req.messages[2].model_dump()["tool_calls"][0]["id"] == "1"


@pytest.mark.parametrize(
    "bad",
    [
        {"messages": []},
        {"messages": [{"role": "wizard", "content": "x"}]},
        {"temperature": 3},
        {"max_tokens": 0},
        {"top_p": 0},
    ],
)
def test_chat_request_rejects_bad_values(bad):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **bad}
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(body)


def test_completion_request_text_or_ids():
    assert CompletionRequest(model="m", prompt="abc", max_tokens=5).output_token_limit == 5
    assert CompletionRequest(model="m", prompt=[1, 2, 3]).prompt == [1, 2, 3]
    with pytest.raises(ValidationError, match="must not be empty"):
        CompletionRequest(model="m", prompt="")
    assert CompletionRequest(model="m", prompt="x", stop=["a", "b"]).stop_strings == ["a", "b"]


def test_chat_response_parses_with_openai_client_types():
    resp = ChatCompletionResponse(
        model="m",
        choices=[
            ChatCompletionChoice(message=ChatResponseMessage(content="hi"), finish_reason="stop")
        ],
        usage=UsageInfo.of(prompt_tokens=100, completion_tokens=5, cached_tokens=96),
    )
    parsed = ChatCompletion.model_validate_json(resp.model_dump_json())
    assert parsed.id.startswith("chatcmpl-")
    assert parsed.choices[0].message.content == "hi"
    assert parsed.usage.total_tokens == 105
    assert parsed.usage.prompt_tokens_details.cached_tokens == 96


def test_chat_chunks_parse_with_openai_client_types():
    first = ChatCompletionChunk(
        id="c1",
        model="m",
        choices=[ChatCompletionChunkChoice(delta=DeltaMessage(role="assistant", content="He"))],
    )
    last = ChatCompletionChunk(id="c1", model="m", choices=[], usage=UsageInfo.of(3, 2, 0))
    for chunk in (first, last):
        parsed = OpenAIChunk.model_validate_json(chunk.model_dump_json())
        assert parsed.object == "chat.completion.chunk"
    assert OpenAIChunk.model_validate_json(last.model_dump_json()).usage.completion_tokens == 2


def test_completion_response_parses_with_openai_client_types():
    resp = CompletionResponse(
        model="m",
        choices=[CompletionChoice(text="abc", finish_reason="length")],
        usage=UsageInfo.of(1, 3, 0),
    )
    parsed = Completion.model_validate_json(resp.model_dump_json())
    assert parsed.choices[0].text == "abc" and parsed.id.startswith("cmpl-")


def test_error_response_shape():
    err = ErrorResponse.of("prompt too long", "invalid_request_error", code=400, param="messages")
    assert json.loads(err.model_dump_json()) == {
        "error": {
            "message": "prompt too long",
            "type": "invalid_request_error",
            "param": "messages",
            "code": 400,
        }
    }


def test_sse_frames_end_with_a_blank_line():
    frame = sse_frame(ErrorResponse.of("boom", "server_error"))
    assert frame.startswith(b"data: {") and frame.endswith(b"}\n\n")
    assert json.loads(frame[len(b"data: ") :])["error"]["message"] == "boom"
    assert SSE_DONE == b"data: [DONE]\n\n"


#: Any JSON value, nested a little: what a client can put anywhere in a body.
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.text(max_size=8) | st.sampled_from(["type", "text"]), inner, max_size=3
        )
    ),
    max_leaves=8,
)
CONTENT_PARTS = st.lists(
    st.dictionaries(st.sampled_from(["type", "text", "refusal", "image_url"]), JSON_VALUES),
    max_size=3,
)


@given(
    role=st.sampled_from(["system", "user", "assistant", "tool"]) | JSON_VALUES,
    content=CONTENT_PARTS | JSON_VALUES,
    fields=st.dictionaries(
        st.sampled_from(sorted(ChatCompletionRequest.model_fields)), JSON_VALUES
    ),
)
@settings(max_examples=300, deadline=None, database=None)
def test_any_json_in_a_chat_request_is_a_model_or_a_validation_error(role, content, fields):
    """A body's values, of any JSON type, give a request or a ValidationError (a 400),
    never another exception (a 500): a content part whose ``type`` was a list once did."""
    body = {"model": "m", **fields, "messages": [{"role": role, "content": content}]}
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError:
        return
    assert all(isinstance(m.text(), str | None) for m in req.messages)
    assert req.output_token_limit is None or req.output_token_limit >= 1
    assert all(isinstance(s, str) for s in req.stop_strings)
    assert isinstance(req.include_usage_in_stream, bool)


@given(fields=st.dictionaries(st.sampled_from(sorted(CompletionRequest.model_fields)), JSON_VALUES))
@settings(max_examples=200, deadline=None, database=None)
def test_any_json_in_a_completion_request_is_a_model_or_a_validation_error(fields):
    try:
        req = CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})
    except ValidationError:
        return
    assert all(isinstance(s, str) for s in req.stop_strings)
    assert isinstance(req.include_usage_in_stream, bool)
