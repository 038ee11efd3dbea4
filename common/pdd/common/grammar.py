"""Structured output as one grammar: what a ``GuidedDecoding`` spec allows the model to write.

The router checks a request's grammar before routing it (a schema the engine cannot
compile is the client's 400, not a worker failure) and every worker that samples the
request compiles the same text into its token mask, so both read it from here. The
grammar engine is llguidance (docs/structured-output.md says why): torch-free and
dependency-free, so the router image can carry it.

``check_grammar`` is what admission asks, and it asks more than "does it compile": the
schemas' size and nesting are bounded (``MAX_SCHEMA_BYTES``, ``MAX_SCHEMA_DEPTH``: the
compile's time grows with the first, llguidance recurses over the second), their text
must be Unicode (no lone surrogate), a schema must admit a finite value
(``schema_finite``), and the engine must get past the grammar's first tokens
(``grammar_probe``), all under llguidance's own work limits (``parser_limits``), the same
in the router and the engine. Every verdict is kept per spec (agents send the same few
schemas again and again, and the worker checks what the router checked).

JSON is compact (no optional whitespace): a model that may add whitespace anywhere can
pad forever, and a sampled random model would, so a schema that bounds its values also
bounds the output's length.
"""

from __future__ import annotations

import functools
import json
import re
from typing import TYPE_CHECKING, Any

import llguidance

from pdd.common.grammar_probe import first_failure
from pdd.common.schema_finite import endless_reference
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


#: The error ``type`` a worker answers a request it cannot compile a grammar for with
#: (and ``TokenEvent.error_type`` of one whose grammar failed in the engine); the router
#: passes it on to the client as a 400 instead of trying another instance.
GRAMMAR_ERROR_TYPE = "invalid_structured_output"

#: Bytes of schema text one spec may hold (a ``json_schema``, or the parameters of every
#: forced tool together): the check's time grows with it (0.1 to 0.4 s at this size on a
#: busy 2-core machine, once per spec), and the router and every worker that samples the
#: request compile it. OpenAI's own limits (10 levels, 5,000 properties, 120,000
#: characters of names and values) are of the same order.
MAX_SCHEMA_BYTES = 64 * 1024
#: Containers nested in one schema (the schema itself is level 1): llguidance recurses
#: over them. Ten levels of objects, OpenAI's limit, nest 21 (a schema, its
#: ``properties``, the next schema...).
MAX_SCHEMA_DEPTH = 40
#: Verdicts kept (``check_grammar``), by spec.
CACHE_SIZE = 64

_SURROGATE = re.compile("[\ud800-\udfff]")


class GrammarError(ValueError):
    """A structured-output spec the grammar engine cannot compile; the message says why."""


def grammar_text(spec: GuidedDecoding) -> str:
    """The llguidance grammar (its JSON serialization) that ``spec`` describes."""
    if spec.kind == "json_object":
        return _json_grammar({"type": "object"})
    if spec.kind == "json_schema":
        return _json_grammar(_parse_schema(spec.schema_text or "{}", "the json_schema"))
    try:
        return llguidance.LLMatcher.grammar_from_lark(_tool_calls_lark(spec))
    except ValueError as e:  # the tools' own fault, whatever llguidance says of it
        raise GrammarError(f"the structured-output grammar cannot be compiled: {e}") from None


def check_grammar(spec: GuidedDecoding) -> str:
    """``spec``'s grammar, or ``GrammarError`` with the reason the engine would fail it:
    over the budgets, it cannot compile (an unknown type, a dangling ``$ref``, an
    unsupported keyword ...), it admits no finite output, or the engine gives up on it
    at its first tokens (the module's note)."""
    grammar, problem = _verdict(spec.model_dump_json())
    if problem is not None:
        raise GrammarError(problem)
    return grammar


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's work limits for every matcher (admission's and the engine's): its
    defaults, which bound each mask in work (lexer fuel, Earley items per step) rather
    than in time, so the router and a worker agree whatever their speed; errors without
    the parser's state (which would echo the grammar back)."""
    return llguidance.LLParserLimits(verbose_errors=False)


@functools.lru_cache(maxsize=CACHE_SIZE)
def _verdict(key: str) -> tuple[str, str | None]:
    """``check_grammar`` of the spec ``key`` serializes: its grammar, or the problem."""
    spec = GuidedDecoding.model_validate_json(key)
    try:
        _check_size(spec)
        grammar = grammar_text(spec)
        for what, text in _schema_texts(spec):
            _check_finite(_parse_schema(text, what), what)
    except GrammarError as e:
        return "", str(e)
    return grammar, first_failure(grammar, parser_limits())


def _schema_texts(spec: GuidedDecoding) -> list[tuple[str, str]]:
    """Each schema ``spec`` holds, with what to call it in an error."""
    if spec.kind == "json_schema":
        return [("the json_schema", spec.schema_text or "{}")]
    return [(f"the parameters of tool {t.name!r}", t.parameters_json) for t in spec.tools]


def _check_size(spec: GuidedDecoding) -> None:
    size = sum(len(text.encode("utf-8", "surrogatepass")) for _, text in _schema_texts(spec))
    if size > MAX_SCHEMA_BYTES:
        raise GrammarError(
            f"the structured-output schemas are {size} bytes; at most {MAX_SCHEMA_BYTES} "
            "are compiled for a request"
        )


def _check_finite(schema: dict[str, Any], what: str) -> None:
    endless = endless_reference(schema)
    if endless is not None:
        raise GrammarError(
            f"{what} admits no finite value: every value of {endless!r} would have to "
            "contain another one (through a required property, minItems or allOf that "
            "refers back to it); make that reference optional"
        )


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
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults=JSON_OPTIONS
        )
    except ValueError as e:  # the schema's own fault, whatever llguidance says of it
        raise GrammarError(f"the structured-output grammar cannot be compiled: {e}") from None


def _parse_schema(text: str, what: str) -> dict[str, Any]:
    """The schema ``text`` holds, within ``MAX_SCHEMA_DEPTH`` and in Unicode."""
    try:
        schema = json.loads(text)
    except RecursionError:
        raise _too_deep(what) from None
    except ValueError as e:
        raise GrammarError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise GrammarError(f"{what} must be a JSON object (a JSON Schema), not {text[:40]!r}")
    _check_tree(schema, what)
    return schema


def _check_tree(schema: dict[str, Any], what: str) -> None:
    """Depth and text of every node, without recursion (the schema may be deep)."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            _check_text(node, what)
        elif isinstance(node, dict | list):
            if depth > MAX_SCHEMA_DEPTH:
                raise _too_deep(what)
            if isinstance(node, dict):
                for key in node:
                    _check_text(key, what)
            stack.extend(
                (child, depth + 1) for child in (node.values() if isinstance(node, dict) else node)
            )


def _check_text(text: str, what: str) -> None:
    found = _SURROGATE.search(text)
    if found is not None:
        raise GrammarError(
            f"{what} holds a lone surrogate (U+{ord(found.group()):04X}), which is not a "
            "Unicode character: send the character itself, or both halves of its pair"
        )


def _too_deep(what: str) -> GrammarError:
    return GrammarError(f"{what} nests more than {MAX_SCHEMA_DEPTH} levels deep")


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
