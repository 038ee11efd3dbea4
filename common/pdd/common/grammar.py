"""Structured output as one grammar: what a ``GuidedDecoding`` spec allows the model to write.

The router checks a request's grammar before routing it (a schema the engine cannot
compile is the client's 400, not a worker failure) and every worker that samples the
request compiles the same text into its token mask, so both read it from here. The
grammar engine is llguidance (docs/structured-output.md says why): torch-free and
dependency-free, so the router image can carry it.

JSON is compact (no optional whitespace): a model that may add whitespace anywhere can
pad forever, and a sampled random model would, so a schema that bounds its values also
bounds the output's length.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance

from pdd.common.vocabulary import ToolCallFormat
from pdd.common.wire import GuidedDecoding, GuidedTool

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

#: llguidance's JSON options for every schema: compact separators, no free whitespace.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}

#: What wraps one call, per format (helper parsers read exactly this; see vocabulary).
_CALL_OPEN = {ToolCallFormat.HERMES: "<tool_call>\n", ToolCallFormat.LLAMA3_JSON: ""}
_CALL_CLOSE = {ToolCallFormat.HERMES: "\n</tool_call>", ToolCallFormat.LLAMA3_JSON: ""}
#: Between two calls of a ``"required"`` choice (Qwen's template separates them so);
#: Llama 3 writes one call per turn, so a format without a separator gets one call.
_CALL_SEPARATOR = {ToolCallFormat.HERMES: "\n"}
#: The key of the arguments object in a call, per format.
_ARGUMENTS_KEY = {ToolCallFormat.HERMES: "arguments", ToolCallFormat.LLAMA3_JSON: "parameters"}


#: The error ``type`` a worker answers a request it cannot compile a grammar for with;
#: the router passes it on to the client as a 400 instead of trying another instance.
GRAMMAR_ERROR_TYPE = "invalid_structured_output"


class GrammarError(ValueError):
    """A structured-output spec the grammar engine cannot compile; the message says why."""


def grammar_text(spec: GuidedDecoding) -> str:
    """The llguidance grammar (its JSON serialization) that ``spec`` describes."""
    if spec.kind == "json_object":
        return _json_grammar({"type": "object"})
    if spec.kind == "json_schema":
        return _json_grammar(_parse_schema(spec.schema_text or "{}", "the json_schema"))
    return llguidance.LLMatcher.grammar_from_lark(_tool_calls_lark(spec))


def check_grammar(spec: GuidedDecoding) -> str:
    """``spec``'s grammar, or ``GrammarError`` with the engine's reason when it cannot
    compile (an unknown type, a dangling ``$ref``, an unsupported keyword ...)."""
    grammar = grammar_text(spec)
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise GrammarError(f"the structured-output grammar cannot be compiled: {problem}")
    return grammar


def call_schema(tool: GuidedTool, fmt: ToolCallFormat) -> dict[str, Any]:
    """The JSON Schema of one call of ``tool`` in ``fmt``: its name, then its arguments."""
    arguments = _parse_schema(tool.parameters_json, f"the parameters of tool {tool.name!r}")
    key = _ARGUMENTS_KEY[fmt]
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, key: arguments},
        "required": ["name", key],
        "additionalProperties": False,
    }


def _json_grammar(schema: dict[str, Any]) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)


def _parse_schema(text: str, what: str) -> dict[str, Any]:
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise GrammarError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise GrammarError(f"{what} must be a JSON object (a JSON Schema), not {text[:40]!r}")
    return schema


def _tool_calls_lark(spec: GuidedDecoding) -> str:
    """A Lark grammar: one call (or several, separated) of one of the listed tools, each
    call's JSON constrained by its schema (llguidance's ``%json`` embeds JSON Schema)."""
    fmt = spec.tool_call_format
    rules = [
        f"tool_{i}: %json {json.dumps({**call_schema(t, fmt), 'x-guidance': JSON_OPTIONS})}"
        for i, t in enumerate(spec.tools)
    ]
    choice = " | ".join(f"tool_{i}" for i in range(len(spec.tools)))
    call = f"call: {_lark_str(_CALL_OPEN[fmt])} ({choice}) {_lark_str(_CALL_CLOSE[fmt])}"
    separator = _CALL_SEPARATOR.get(fmt)
    if spec.single_call or separator is None:
        start = "start: call"
    else:
        start = f"start: call ({_lark_str(separator)} call)*"
    return "\n".join([start, call, *rules]) + "\n"


def _lark_str(text: str) -> str:
    """A Lark string literal; an empty one matches nothing (Lark has no empty literal)."""
    return json.dumps(text) if text else ""
