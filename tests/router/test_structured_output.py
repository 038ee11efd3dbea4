"""A chat request's response_format / tool_choice as the workers' grammar spec (pure)."""

import json

import pytest

from pdd.common.vocabulary import ToolCallFormat
from pdd.common.wire import GuidedDecoding
from pdd.router.errors import InvalidRequestError
from pdd.router.openai_protocol import ChatCompletionRequest
from pdd.router.structured_output import guided_decoding

pytestmark = pytest.mark.unit

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now"}},
]


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)


def spec(fmt: ToolCallFormat = ToolCallFormat.HERMES, **fields) -> GuidedDecoding | None:
    return guided_decoding(request(**fields), fmt)


def test_free_text_needs_no_grammar() -> None:
    assert spec() is None
    assert spec(response_format={"type": "text"}) is None
    assert spec(tools=TOOLS, tool_choice="auto") is None  # the model may answer in text
    assert spec(tools=TOOLS, tool_choice="none") is None
    assert spec(tools=TOOLS) is None


def test_json_object_and_json_schema() -> None:
    assert spec(response_format={"type": "json_object"}) == GuidedDecoding(kind="json_object")
    got = spec(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": WEATHER, "strict": True},
        }
    )
    assert got is not None and got.kind == "json_schema"
    assert json.loads(got.schema_text or "") == WEATHER


def test_a_json_schema_format_without_a_schema_is_any_object() -> None:
    got = spec(response_format={"type": "json_schema", "json_schema": {"name": "w"}})
    assert got == GuidedDecoding(kind="json_object")


def test_a_named_tool_choice_forces_one_call_of_that_tool() -> None:
    named = {"type": "function", "function": {"name": "weather"}}
    got = spec(tools=TOOLS, tool_choice=named)
    assert got is not None and got.kind == "tool_calls" and got.single_call
    assert [t.name for t in got.tools] == ["weather"]
    assert json.loads(got.tools[0].parameters_json) == WEATHER


def test_required_forces_one_or_more_calls_of_any_listed_tool() -> None:
    got = spec(ToolCallFormat.LLAMA3_JSON, tools=TOOLS, tool_choice="required")
    assert got is not None and not got.single_call
    assert got.tool_call_format is ToolCallFormat.LLAMA3_JSON
    assert [(t.name, json.loads(t.parameters_json)) for t in got.tools] == [
        ("weather", WEATHER),
        ("now", {"type": "object"}),  # a tool without parameters takes an object
    ]
    no_parallel = spec(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert no_parallel is not None and no_parallel.single_call


def test_a_forced_tool_call_and_a_json_format_together_are_a_400() -> None:
    with pytest.raises(InvalidRequestError, match="drop one") as e:
        spec(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert e.value.param == "response_format"


@pytest.mark.parametrize(
    ("schema", "reason"),
    [({"type": "strnig"}, "strnig"), ({"$ref": "#/nowhere"}, "nowhere")],
)
def test_a_schema_the_engine_cannot_compile_is_a_400_with_its_reason(schema, reason) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
    with pytest.raises(InvalidRequestError, match=reason) as e:
        spec(response_format=fmt)
    assert e.value.status == 400 and e.value.param == "response_format"


def test_tool_parameters_the_engine_cannot_compile_are_a_400_on_tools() -> None:
    tools = [{"type": "function", "function": {"name": "t", "parameters": {"type": "nope"}}}]
    with pytest.raises(InvalidRequestError, match="nope") as e:
        spec(tools=tools, tool_choice="required")
    assert e.value.param == "tools"


#: The schema that once failed every request in the batch it joined.
RECURSIVE = {
    "$defs": {
        "n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}
    },
    "$ref": "#/$defs/n",
}


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize(
    ("schema", "reason"),
    [
        (RECURSIVE, "admits no finite value"),
        (_nested(200), "levels deep"),
        ({"enum": ["ok", "\ud800"]}, "lone surrogate"),
        ({"enum": [f"value number {i}" for i in range(5000)]}, "bytes"),
    ],
)
def test_a_schema_no_engine_could_serve_is_a_400_before_any_worker(schema, reason) -> None:
    """Not a RecursionError, a ValueError from the grammar engine (500s) or a schema that
    fails every request in the batch it joins on a worker: the client's 400, with why."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(InvalidRequestError, match=reason) as e:
        spec(response_format=fmt)
    assert e.value.status == 400 and e.value.param == "response_format"
    tools = [{"type": "function", "function": {"name": "t", "parameters": schema}}]
    with pytest.raises(InvalidRequestError, match=reason) as e:
        spec(tools=tools, tool_choice="required")
    assert e.value.param == "tools"
