"""Structured-output grammars: each kind compiles; a bad schema is refused with why: one
that cannot compile, admits no finite value, is over the size or depth budget, holds a lone
surrogate, or that the engine gives up on at its first tokens."""

import json

import pytest

from pdd.common import grammar as grammar_module
from pdd.common.grammar import (
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_DEPTH,
    GrammarError,
    call_schema,
    check_grammar,
    grammar_text,
    parser_limits,
)
from pdd.common.grammar_probe import first_failure
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


#: The schema that once failed every request in the batch it joined: the value of the
#: required property "c" must again be such an object, without end.
RECURSIVE = {
    "$defs": {
        "n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}
    },
    "$ref": "#/$defs/n",
}


def schema_spec(schema: object) -> GuidedDecoding:
    return GuidedDecoding(kind="json_schema", schema_text=json.dumps(schema))


def nested(depth: int) -> dict:
    """A schema ``depth`` objects deep (each level two containers: it, its properties)."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize(
    ("schema", "blamed"),
    [
        (RECURSIVE, "'#/$defs/n'"),
        ({"type": "array", "minItems": 1, "items": {"$ref": "#"}}, "'#'"),
        ({"anyOf": [{"$ref": "#/$defs/o"}, {"allOf": [{"$ref": "#"}]}],
          "$defs": {"o": {"type": "object", "properties": {"x": {"$ref": "#"}},
                          "required": ["x"]}}}, "'#"),
    ],
)  # fmt: skip
def test_a_schema_that_admits_no_finite_value_is_refused_naming_where(schema, blamed) -> None:
    with pytest.raises(GrammarError, match="admits no finite value") as e:
        check_grammar(schema_spec(schema))
    assert blamed in str(e.value)
    tools = (GuidedTool(name="loop", parameters_json=json.dumps(schema)),)
    with pytest.raises(GrammarError, match="tool 'loop' admits no finite value"):
        check_grammar(GuidedDecoding(kind="tool_calls", tools=tools))


@pytest.mark.parametrize(
    "schema",
    [
        {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}},
         "$ref": "#/$defs/n"},  # the recursion is optional
        {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
         "required": ["kids"]},  # a tree: an empty array ends it
        {"anyOf": [{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
                   {"type": "null"}]},  # one branch ends
        {"properties": {"c": {"$ref": "#"}}, "required": ["c"]},  # any type: a string ends
    ],
)  # fmt: skip
def test_recursive_schemas_with_a_way_out_compile(schema) -> None:
    assert check_grammar(schema_spec(schema)) == grammar_text(schema_spec(schema))


def test_a_schema_nested_past_the_depth_budget_is_refused_without_recursing() -> None:
    assert check_grammar(schema_spec(nested(MAX_SCHEMA_DEPTH // 2 - 1)))
    for schema_text in (json.dumps(nested(200)), "[" * 30_000 + "]" * 30_000):
        spec = GuidedDecoding(kind="json_schema", schema_text=schema_text)
        with pytest.raises(GrammarError, match=f"more than {MAX_SCHEMA_DEPTH} levels"):
            check_grammar(spec)


def test_schemas_over_the_size_budget_are_refused() -> None:
    props = {f"p{i}": {"type": "integer"} for i in range(MAX_SCHEMA_BYTES // 20)}
    big = {"type": "object", "properties": props}
    with pytest.raises(GrammarError, match=f"at most {MAX_SCHEMA_BYTES}"):
        check_grammar(schema_spec(big))
    half = json.dumps({"type": "object", "properties": dict(list(props.items())[::2])})
    tools = (GuidedTool(name="a", parameters_json=half), GuidedTool(name="b", parameters_json=half))
    with pytest.raises(GrammarError, match=r"schemas are \d+ bytes"):  # the tools together
        check_grammar(GuidedDecoding(kind="tool_calls", tools=tools))


def test_a_lone_surrogate_in_a_schema_is_refused() -> None:
    for schema in ({"enum": ["\ud800"]}, {"type": "object", "properties": {"\udfff": {}}}):
        with pytest.raises(GrammarError, match="lone surrogate"):
            check_grammar(schema_spec(schema))


def test_a_grammar_the_engine_gives_up_on_at_its_first_tokens_is_found() -> None:
    """The probe alone (the finite-value check aside): llguidance compiles the recursive
    schema, then gives up forcing its endless prefix at the first token."""
    assert first_failure(grammar_text(schema_spec(WEATHER)), parser_limits()) is None
    failure = first_failure(grammar_text(schema_spec(RECURSIVE)), parser_limits())
    assert failure is not None and "gives up" in failure and "<" not in failure  # no state
    nothing = first_failure(grammar_text(schema_spec({"$ref": "#"})), parser_limits())
    assert nothing is not None


def test_a_verdict_is_computed_once_per_spec(monkeypatch) -> None:
    probes = []
    real = grammar_module.first_failure
    monkeypatch.setattr(grammar_module, "first_failure", lambda *a: probes.append(a) or real(*a))
    grammar_module._verdict.cache_clear()
    bad = schema_spec({"type": "strnig"})
    for _ in range(3):
        assert check_grammar(schema_spec(WEATHER))
        with pytest.raises(GrammarError, match="strnig"):
            check_grammar(bad)
    assert len(probes) == 2
