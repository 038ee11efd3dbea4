"""Structured output with the official openai client against ``pdd router`` and real
workers serving the built-in ``tiny`` model (random weights): only the grammar makes the
output JSON, so a parse proves the mask was applied.

Schemas here bound every value, so the grammar forces the output to end within
``max_tokens`` (``stop``, never ``length``); ``json_object`` bounds nothing, so its
request is seeded (the tiny model's weights are fixed) with one that closes its object.
"""

import json
from typing import Annotated, Literal

import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.integration

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "adopt", "description": "Adopt a pet", "parameters": PERSON},
    },
    {"type": "function", "function": {"name": "nap", "parameters": NO_ARGUMENTS}},
]
#: Enough for the longest output any of the bounded grammars here allows.
MAX_TOKENS = 160
#: A seed whose json_object output (a key holding a nested object) closes within
#: MAX_TOKENS; others sample keys that run on to ``length``, as they may.
JSON_OBJECT_SEED = 7


class Person(BaseModel):
    name: Annotated[str, Field(max_length=5)]
    age: Annotated[int, Field(ge=0, le=99)]
    pet: Literal["cat", "dog"]


@pytest.fixture(scope="module")
def client(worker_flags, start_router) -> openai.OpenAI:
    router = start_router(*worker_flags())
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)


def chat(client: openai.OpenAI, **kwargs):
    args = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 1.0}
    return client.chat.completions.create(**{**args, **kwargs})


def tool_calls(choice) -> list[tuple[str, dict]]:
    """(name, arguments) of each call the router parsed out of a forced call's text: the
    grammar writes the model's format, so the parser finds every call and no text."""
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content and choice.message.tool_calls  # "" streamed: role frame
    return [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_output_parses_and_validates(client, seed) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    got = chat(client, response_format=fmt, seed=seed)
    assert got.choices[0].finish_reason == "stop"
    Person.model_validate_json(got.choices[0].message.content)


def test_streamed_json_schema_output_parses(client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    chunks = list(chat(client, response_format=fmt, seed=4, stream=True))
    Person.model_validate_json("".join(c.choices[0].delta.content or "" for c in chunks))


def test_json_object_output_is_an_object(client) -> None:
    got = chat(client, response_format={"type": "json_object"}, seed=JSON_OBJECT_SEED)
    assert got.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(got.choices[0].message.content), dict)


def test_the_sdk_parses_into_a_pydantic_model(client) -> None:
    got = client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=Person, max_tokens=MAX_TOKENS, seed=5
    )
    assert isinstance(got.choices[0].message.parsed, Person)


def test_a_named_tool_choice_calls_that_tool_with_valid_arguments(client) -> None:
    named = {"type": "function", "function": {"name": "adopt"}}
    got = chat(client, tools=TOOLS, tool_choice=named, seed=6)
    [(name, arguments)] = tool_calls(got.choices[0])
    assert name == "adopt"
    Person.model_validate(arguments)


def test_a_required_tool_choice_calls_listed_tools(client) -> None:
    got = chat(client, tools=TOOLS, tool_choice="required", seed=7)
    calls = tool_calls(got.choices[0])
    for name, arguments in calls:
        assert name in ("adopt", "nap") and isinstance(arguments, dict)
        if name == "adopt":
            Person.model_validate(arguments)


def test_a_streamed_forced_call_accumulates_in_the_sdk(client) -> None:
    named = {"type": "function", "function": {"name": "adopt"}}
    with client.chat.completions.stream(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        tools=TOOLS,
        tool_choice=named,
        seed=8,
    ) as stream:
        final = stream.get_final_completion()
    [(name, arguments)] = tool_calls(final.choices[0])
    assert name == "adopt"
    Person.model_validate(arguments)


def test_a_schema_the_engine_cannot_compile_is_a_400_with_the_reason(client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "strnig"}}}
    with pytest.raises(openai.BadRequestError, match="strnig") as e:
        chat(client, response_format=fmt)
    assert e.value.body["param"] == "response_format"


#: The schema a user sent beside another user's long chat, which once failed every
#: request in the batch it joined: "c" is required and is itself such an object.
RECURSIVE = {
    "$defs": {
        "n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}
    },
    "$ref": "#/$defs/n",
}


def test_a_schema_that_admits_no_finite_output_is_a_400_not_a_429(client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": RECURSIVE}}
    with pytest.raises(openai.BadRequestError, match="admits no finite value") as e:
        chat(client, response_format=fmt)
    assert e.value.body["param"] == "response_format"
    assert e.value.body["type"] == "invalid_request_error"
    assert chat(client, max_tokens=4).choices  # and the router serves on
