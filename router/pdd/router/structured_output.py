"""A chat request's structured-output fields as the workers' ``GuidedDecoding`` spec.

``response_format`` (``json_object``, ``json_schema``) and a forcing ``tool_choice``
(``"required"`` or a named function) become one grammar the workers enforce as a token
mask. ``"auto"`` and ``"none"`` force nothing: the model may answer in text, and the
tool-call parser reads whatever calls it writes. The spec is checked here with the
engine the workers use, so a schema it cannot compile is the client's 400 before any
instance is busy with it.
"""

from __future__ import annotations

import json

from pdd.common.grammar import GrammarError, check_grammar
from pdd.common.vocabulary import ToolCallFormat
from pdd.common.wire import GuidedDecoding, GuidedTool
from pdd.router.errors import InvalidRequestError
from pdd.router.openai_protocol import ChatCompletionRequest, NamedToolChoice, ToolDefinition


def guided_decoding(
    request: ChatCompletionRequest, tool_call_format: ToolCallFormat | None
) -> GuidedDecoding | None:
    """The grammar ``request`` asks for, or None for free text. ``tool_call_format``: how
    the model writes a call (the one its parser reads; None where the request's tools are
    not read for calls). Raises ``InvalidRequestError`` (400) naming the field when it
    asks for two at once, for a forced call in no known format, or for a grammar the
    engine cannot compile."""
    forced = _forced_tools(request)
    fmt = request.response_format
    if forced is not None and fmt is not None and fmt.type != "text":
        raise InvalidRequestError(
            f"tool_choice forces a tool call, which cannot also be response_format {fmt.type!r}; "
            "drop one of them",
            param="response_format",
        )
    if forced is not None:
        if tool_call_format is None:
            raise InvalidRequestError(
                "tool_choice forces a call, but this model's tool-call format is unknown: "
                "start the router with --tool-call-format",
                param="tool_choice",
            )
        tools, single = forced
        spec = GuidedDecoding(
            kind="tool_calls",
            tools=tuple(_guided_tool(t) for t in tools),
            tool_call_format=tool_call_format,
            single_call=single,
        )
        return _checked(spec, "tools")
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object" or fmt.json_schema is None or fmt.json_schema.schema_ is None:
        return _checked(GuidedDecoding(kind="json_object"), "response_format")
    schema = json.dumps(fmt.json_schema.schema_)
    return _checked(GuidedDecoding(kind="json_schema", schema_text=schema), "response_format")


def _forced_tools(request: ChatCompletionRequest) -> tuple[list[ToolDefinition], bool] | None:
    """The tools a call must name and whether exactly one call is made, when forced."""
    choice, tools = request.tool_choice, request.tools or []
    if isinstance(choice, NamedToolChoice):
        return [t for t in tools if t.function.name == choice.function.name], True
    if choice == "required":
        return tools, not request.parallel_tool_calls
    return None


def _guided_tool(tool: ToolDefinition) -> GuidedTool:
    parameters = tool.function.parameters or {"type": "object"}
    return GuidedTool(name=tool.function.name, parameters_json=json.dumps(parameters))


def _checked(spec: GuidedDecoding, param: str) -> GuidedDecoding:
    try:
        check_grammar(spec)
    except GrammarError as e:
        raise InvalidRequestError(str(e), param=param) from None
    return spec
