"""Tool calls read out of a finished output text, in the model's own format.

A model writes a call the way its chat template taught it (``ToolCallFormat``):

- ``hermes`` (Hermes, Qwen2, Qwen3): ``<tool_call>{"name": .., "arguments": {..}}</tool_call>``
  blocks, possibly several, possibly after some text; the last may lack its closing
  tag when the model stopped right after the JSON.
- ``llama3_json`` (Llama 3.x): the whole output is one JSON object ``{"name": ..,
  "parameters": {..}}`` (``arguments`` accepted too), or several separated by ``;``,
  optionally after ``<|python_tag|>``.

What does not parse as a call stays text: a model that wrote broken JSON gets its text
back as ``content`` (as vLLM does), not an error. The format is the router's
``tool_call_format`` setting, detected from the chat template (``detect_format``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pdd.common.vocabulary import ToolCallFormat

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
LLAMA3_PYTHON_TAG = "<|python_tag|>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as a JSON text."""

    name: str
    arguments: str
    id: str = ""

    def with_id(self) -> ToolCall:
        return ToolCall(self.name, self.arguments, self.id or new_call_id())


@dataclass(frozen=True)
class ParsedOutput:
    """An output split into the text outside the calls (None when only calls) and calls."""

    content: str | None
    calls: list[ToolCall]


def new_call_id() -> str:
    """An OpenAI-style tool-call id (``call_`` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def call_from_object(obj: Any) -> ToolCall | None:
    """``{"name": .., "arguments"|"parameters": ..}`` -> a call, or None if it is not one.
    Arguments given as a JSON string (some models write them so) are taken as they are."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return ToolCall(obj["name"], args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_hermes(text: str) -> ParsedOutput:
    """Every ``<tool_call>`` block holding a call; the text around them is the content."""
    calls: list[ToolCall] = []
    content: list[str] = []
    end = 0
    for match in _HERMES_BLOCK.finditer(text):
        try:
            call = call_from_object(json.loads(match.group(1)))
        except json.JSONDecodeError:
            call = None
        if call is None:
            continue
        content.append(text[end : match.start()])
        calls.append(call.with_id())
        end = match.end()
    content.append(text[end:])
    return _parsed("".join(content), calls)


def parse_llama3_json(text: str) -> ParsedOutput:
    """The output as ``;``-separated call objects; anything else is plain content."""
    body = text.strip()
    if body.startswith(LLAMA3_PYTHON_TAG):
        body = body[len(LLAMA3_PYTHON_TAG) :].lstrip()
    calls: list[ToolCall] = []
    decoder = json.JSONDecoder()
    position = 0
    while position < len(body):
        try:
            obj, position = decoder.raw_decode(body, position)
        except json.JSONDecodeError:
            return ParsedOutput(text, [])
        call = call_from_object(obj)
        if call is None:
            return ParsedOutput(text, [])
        calls.append(call.with_id())
        position = _skip_separator(body, position)
    return ParsedOutput(None, calls) if calls else ParsedOutput(text, [])


def _skip_separator(body: str, position: int) -> int:
    while position < len(body) and body[position] in " \t\r\n;":
        position += 1
    return position


def _parsed(content: str, calls: list[ToolCall]) -> ParsedOutput:
    if not calls:
        return ParsedOutput(content, [])
    stripped = content.strip()
    return ParsedOutput(stripped or None, calls)


PARSERS = {ToolCallFormat.HERMES: parse_hermes, ToolCallFormat.LLAMA3_JSON: parse_llama3_json}


def parse_tool_calls(fmt: ToolCallFormat, text: str) -> ParsedOutput:
    return PARSERS[fmt](text)


def detect_format(template_source: str | None) -> ToolCallFormat | None:
    """The format a chat template teaches, from the markers it writes: Hermes/Qwen
    templates show ``<tool_call>``; Llama 3.x templates ``<|python_tag|>`` or the
    ``"parameters"`` call shape. None: the template shows no tool-call format."""
    if template_source is None:
        return None
    if HERMES_OPEN in template_source:
        return ToolCallFormat.HERMES
    if LLAMA3_PYTHON_TAG in template_source or '"parameters"' in template_source:
        return ToolCallFormat.LLAMA3_JSON
    return None
