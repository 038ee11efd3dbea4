"""Structured-output grammars: each kind compiles; a bad schema is refused with why."""

import json

import pytest

from pdd.common.grammar import GrammarError, call_schema, check_grammar, grammar_text
from pdd.common.vocabulary import ToolCallFormat
from pdd.common.wire import GuidedDecoding, GuidedTool

pytestmark = pytest.mark.unit

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_call_schema_names_the_arguments_key_per_format() -> None:
    tool = GuidedTool(name="now")
    hermes = call_schema(tool, ToolCallFormat.HERMES)
    llama = call_schema(tool, ToolCallFormat.LLAMA3_JSON)
    assert hermes["required"] == ["name", "arguments"]
    assert llama["required"] == ["name", "parameters"]
    assert hermes["properties"]["name"] == {"const": "now"}


def test_grammar_text_of_each_kind_compiles() -> None:
    tools = (GuidedTool(name="a"), GuidedTool(name="b"))
    for s in [
        GuidedDecoding(kind="json_object"),
        GuidedDecoding(kind="json_schema", schema_text=json.dumps(WEATHER)),
        GuidedDecoding(kind="tool_calls", tools=tools, single_call=False),
        GuidedDecoding(kind="tool_calls", tools=tools, tool_call_format=ToolCallFormat.LLAMA3_JSON),
    ]:
        assert check_grammar(s) == grammar_text(s)


def test_a_schema_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(GrammarError, match="JSON object"):
        grammar_text(GuidedDecoding(kind="json_schema", schema_text="[1]"))
    with pytest.raises(GrammarError, match="not valid JSON"):
        grammar_text(GuidedDecoding(kind="json_schema", schema_text="{"))
