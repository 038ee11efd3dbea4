"""Tool-call parsers: whole outputs and streams, fed fixed texts, read as the SDK reads them.

A stream is checked the way the openai SDK accumulates it: per ``index`` the first
entry gives id and name, the arguments are the concatenation of every piece; content
is the concatenation of the content pieces. Every stream test feeds the text in every
split (one character at a time, and in two pieces at every cut), so a tag or brace
that straddles two deltas is covered.
"""

from __future__ import annotations

import json

import pytest

from pdd.common.vocabulary import ToolCallFormat
from pdd.router.chat_template import PLAIN_TOOL_INSTRUCTION
from pdd.router.tool_call_stream import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    StreamEvent,
    tool_call_stream,
)
from pdd.router.tool_calls import detect_format, parse_tool_calls

pytestmark = pytest.mark.unit

HERMES = ToolCallFormat.HERMES
LLAMA3 = ToolCallFormat.LLAMA3_JSON

TWO_CALLS = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, {"x": "}"}]}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)


def accumulate(events: list[StreamEvent]) -> tuple[str, list[dict]]:
    """Content and calls as the SDK's stream accumulator builds them."""
    content = ""
    calls: dict[int, dict] = {}
    for event in events:
        if isinstance(event, ContentDelta):
            content += event.text
        elif isinstance(event, CallStart):
            assert event.index not in calls and event.id.startswith("call_")
            calls[event.index] = {"name": event.name, "arguments": ""}
        else:
            assert isinstance(event, ArgumentsDelta) and event.index in calls
            calls[event.index]["arguments"] += event.text
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)]


def streamed(fmt: ToolCallFormat, pieces: list[str]) -> tuple[str, list[dict]]:
    stream = tool_call_stream(fmt)
    events: list[StreamEvent] = []
    for piece in pieces:
        events += stream.feed(piece)
    events += stream.finish()
    content, calls = accumulate(events)
    assert stream.calls == len(calls)
    return content, calls


def splits(text: str) -> list[list[str]]:
    return [list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]


def decoded(calls: list[dict]) -> list[tuple[str, object]]:
    return [(c["name"], json.loads(c["arguments"])) for c in calls]


WEATHER = ("get_weather", {"city": "Paris", "days": [1, {"x": "}"}]})


def test_hermes_two_calls_after_text() -> None:
    parsed = parse_tool_calls(HERMES, TWO_CALLS)
    assert parsed.content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        WEATHER,
        ("get_time", {"tz": "CET"}),
    ]
    assert len({c.id for c in parsed.calls}) == 2
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in parsed.calls)


@pytest.mark.parametrize("pieces", splits(TWO_CALLS))
def test_hermes_stream_equals_the_whole_parse_in_any_split(pieces) -> None:
    content, calls = streamed(HERMES, pieces)
    assert content.strip() == "Let me look."
    assert "<" not in content  # no fragment of a tag leaked as content
    assert decoded(calls) == [WEATHER, ("get_time", {"tz": "CET"})]


def test_hermes_arguments_stream_in_pieces_before_the_call_closes() -> None:
    stream = tool_call_stream(HERMES)
    events = stream.feed('<tool_call>{"name": "f", "arguments": {"a": ')
    assert [type(e) for e in events] == [CallStart, ArgumentsDelta]
    assert events[1] == ArgumentsDelta(0, '{"a":')  # the space may lead to the closing "}"
    assert stream.feed("1}") == [ArgumentsDelta(0, " 1")]  # "}" may close the call object
    assert stream.feed("}</tool_call>") == [ArgumentsDelta(0, "}")]


def test_hermes_unclosed_last_call_and_no_arguments() -> None:
    text = '<tool_call>{"name": "ping"}'
    parsed = parse_tool_calls(HERMES, text)
    assert parsed.content is None and [(c.name, c.arguments) for c in parsed.calls] == [
        ("ping", "{}")
    ]
    for pieces in splits(text):
        assert streamed(HERMES, pieces) == ("", [{"name": "ping", "arguments": "{}"}])


def test_hermes_parameters_key_and_string_arguments() -> None:
    text = (
        '<tool_call>{"name": "a", "parameters": {"k": 1}}</tool_call>'
        '<tool_call>{"name": "b", "arguments": "{\\"k\\": 2}"}</tool_call>'
    )
    expected = [("a", {"k": 1}), ("b", {"k": 2})]
    assert [(c.name, json.loads(c.arguments)) for c in parse_tool_calls(HERMES, text).calls] == (
        expected
    )
    for pieces in splits(text):
        assert decoded(streamed(HERMES, pieces)[1]) == expected


def test_hermes_without_calls_is_plain_text_even_with_a_partial_tag() -> None:
    text = "a < b and <tool but no call"
    assert parse_tool_calls(HERMES, text).content == text
    for pieces in splits(text):
        assert streamed(HERMES, pieces) == (text, [])


def test_hermes_broken_json_stays_content() -> None:
    text = "<tool_call>not json</tool_call> done"
    parsed = parse_tool_calls(HERMES, text)
    assert parsed.content == text and parsed.calls == []
    assert streamed(HERMES, [text]) == (text, [])


LLAMA_TWO = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": '
    '[1, {"x": "}"}]}}; {"name": "get_time", "arguments": {"tz": "CET"}}'
)


LLAMA_CALLS = [
    LLAMA_TWO,
    ' \n{"name": "get_weather", "parameters": {"city": "Paris", "days": [1, {"x": "}"}]}}',
    '{"parameters": {"q": "a \\"name\\": \\"x\\" {"}, "name": "search"}',  # name after args
    '{"name": "ping"};{"name": "b", "arguments": "{\\"k\\": 2}"}',  # none; a JSON string
    '<|python_tag|> {"name": "f\\u00e9", "parameters": {"name": "inner", "n": [[], {}]}} ;\n',
]


def every_split(text: str) -> list[list[str]]:
    """One character at a time, in two pieces at every cut, and in three pieces at every
    pair of cuts a few characters apart (a tag, key or brace straddling two deltas)."""
    threes = [
        [text[:i], text[i:j], text[j:]]
        for i in range(len(text) + 1)
        for j in range(i, min(len(text), i + 6) + 1)
    ]
    return splits(text) + threes


@pytest.mark.parametrize("text", LLAMA_CALLS)
def test_llama3_json_stream_equals_the_whole_parse_in_any_split(text) -> None:
    parsed = parse_tool_calls(LLAMA3, text)
    assert parsed.content is None and parsed.calls
    expected = [(c.name, json.loads(c.arguments)) for c in parsed.calls]
    for pieces in every_split(text):
        content, calls = streamed(LLAMA3, pieces)
        assert content == "" and decoded(calls) == expected, pieces


def test_llama3_json_calls_with_parameters_or_arguments() -> None:
    parsed = parse_tool_calls(LLAMA3, LLAMA_TWO)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        WEATHER,
        ("get_time", {"tz": "CET"}),
    ]


def test_llama3_json_name_and_arguments_stream_as_they_arrive() -> None:
    stream = tool_call_stream(LLAMA3)
    assert stream.feed('<|python_tag|>{"name": "get_wea') == []
    [start] = stream.feed('ther", "parameters": ')
    assert isinstance(start, CallStart) and start.index == 0 and start.name == "get_weather"
    assert stream.feed('{"city": "Pa') == [ArgumentsDelta(0, '{"city": "Pa')]
    assert stream.feed('ris"}') == [ArgumentsDelta(0, 'ris"}')]
    assert stream.feed("}; ") == []  # the call object's own brace and the separator
    second, brace = stream.feed('{"name": "get_time", "arguments": {')
    assert isinstance(second, CallStart) and second.index == 1 and brace == ArgumentsDelta(1, "{")
    assert stream.feed('"tz": "CET"}}') == [ArgumentsDelta(1, '"tz": "CET"}')]
    assert stream.finish() == [] and stream.calls == 2


LLAMA3_NO_CALL = [
    "The weather is fine.",
    '{"city": "Paris"}',
    '  {"city": {"name": "Paris"}} and more',
    "<|python_tag|>",
    "<|python_tag|>print(1)",
    ' \n{"na\\qme": "f", "parameters": {}}',
]


@pytest.mark.parametrize("text", [*LLAMA3_NO_CALL, '{"name": "f", "parameters": {} trailing'])
def test_llama3_json_anything_else_is_content(text) -> None:
    assert parse_tool_calls(LLAMA3, text).content == text
    assert parse_tool_calls(LLAMA3, text).calls == []


@pytest.mark.parametrize("text", LLAMA3_NO_CALL)
def test_llama3_json_stream_of_an_output_without_a_call_is_its_text(text) -> None:
    for pieces in every_split(text):
        assert streamed(LLAMA3, pieces) == (text, []), pieces


def test_llama3_json_a_call_already_sent_is_kept_when_the_format_breaks_after_it() -> None:
    """A stream cannot take back a call: text that breaks the format after a call's name
    streams after it (the whole-output parse makes all of it content)."""
    for pieces in every_split('{"name": "f", "parameters": {"a": 1}} trailing'):
        assert streamed(LLAMA3, pieces) == ("trailing", [{"name": "f", "arguments": '{"a": 1}'}])
    for pieces in splits('{"name": "f", "parameters": {"a": '):  # cut off by max_tokens
        assert streamed(LLAMA3, pieces) == ("", [{"name": "f", "arguments": '{"a": '}])


def test_detect_format_from_the_template() -> None:
    assert detect_format("... <tool_call>\n{...}\n</tool_call> ...") is HERMES
    llama = 'Respond in the format {"name": function name, "parameters": dictionary}'
    assert detect_format(llama) is LLAMA3
    assert detect_format("{{ '<|python_tag|>' + x }}") is LLAMA3
    assert detect_format("{{ messages }}") is None
    assert detect_format(PLAIN_TOOL_INSTRUCTION) is HERMES  # the fallback teaches Hermes
