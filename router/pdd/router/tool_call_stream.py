"""Tool calls read out of an output while it streams, as the OpenAI SDK accumulates them.

The SDK builds each call from ``delta.tool_calls`` entries keyed by ``index``: the first
entry of a call carries ``id``, ``type`` and the function's ``name``; later ones append
to ``function.arguments``. So a stream parser turns text deltas into three events:
content, a call's start (once its name is known) and a piece of its arguments.

Hermes (``<tool_call>`` blocks): text outside the blocks streams as content, except a
tail that may be the start of ``<tool_call>`` (held back until the next text decides,
so no tag fragment ever reaches the client as content); inside a block the arguments
stream as the model writes them, holding back only what may be the call object's own
closing brace. Llama-3 JSON: an output that starts with ``{`` (or ``<|python_tag|>``)
is a call and is parsed when it ends (its calls come out then, arguments in one
piece); any other output streams as content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Protocol

from pdd.common.vocabulary import ToolCallFormat
from pdd.router.tool_calls import (
    HERMES_CLOSE,
    HERMES_OPEN,
    LLAMA3_PYTHON_TAG,
    call_from_object,
    new_call_id,
    parse_llama3_json,
)


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


StreamEvent = ContentDelta | CallStart | ArgumentsDelta


class ToolCallStream(Protocol):
    """Text deltas in, events out; ``calls`` counts the calls started so far."""

    calls: int

    def feed(self, text: str) -> list[StreamEvent]: ...

    def finish(self) -> list[StreamEvent]: ...


def partial_prefix(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS_KEY = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
#: What may still be the call object's closing brace (and the space around it).
_OBJECT_TAIL = re.compile(r"\s*(?:\}\s*)?$")


@dataclass
class _OpenCall:
    """One ``<tool_call>`` block being read: its raw body and what has been sent of it."""

    index: int
    body: str = ""
    started: bool = False
    args_start: int | None = None
    args_sent: int = 0


class HermesStream:
    def __init__(self) -> None:
        self.calls = 0
        self._outside = ""  # held-back text that may begin <tool_call>
        self._open: _OpenCall | None = None

    def feed(self, text: str) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        while text:
            text = self._inside(text, events) if self._open else self._between(text, events)
        return events

    def finish(self) -> list[StreamEvent]:
        """The output ended: a block never closed is finished as it stands (the model may
        stop right after the JSON); held-back text was not a tag after all."""
        events: list[StreamEvent] = []
        if self._open is not None:
            self._close(events, closed=False)
        if self._outside:
            events.append(ContentDelta(self._outside))
            self._outside = ""
        return events

    def _between(self, text: str, events: list[StreamEvent]) -> str:
        """Content up to a ``<tool_call>`` tag; returns the text after the tag."""
        pending = self._outside + text
        at = pending.find(HERMES_OPEN)
        if at >= 0:
            self._emit_content(pending[:at], events)
            self._outside = ""
            self._open = _OpenCall(self.calls)
            return pending[at + len(HERMES_OPEN) :]
        keep = partial_prefix(pending, HERMES_OPEN)
        self._emit_content(pending[: len(pending) - keep], events)
        self._outside = pending[len(pending) - keep :]
        return ""

    def _emit_content(self, text: str, events: list[StreamEvent]) -> None:
        # Whitespace between calls is layout, not content.
        if text and not (self.calls and not text.strip()):
            events.append(ContentDelta(text))

    def _inside(self, text: str, events: list[StreamEvent]) -> str:
        """Arguments up to ``</tool_call>``; returns the text after the closing tag."""
        call = self._open
        assert call is not None
        call.body += text
        at = call.body.find(HERMES_CLOSE)
        if at < 0:  # a tail that may begin </tool_call> is not the call's text (yet)
            visible = len(call.body) - partial_prefix(call.body, HERMES_CLOSE)
            self._advance(call, events, done=False, visible=visible)
            return ""
        rest = call.body[at + len(HERMES_CLOSE) :]
        call.body = call.body[:at]
        self._close(events, closed=True)
        return rest

    def _close(self, events: list[StreamEvent], closed: bool) -> None:
        """The block is complete: a call without arguments gets ``{}``; a block that never
        named a function was not a call, and goes out as the text it was."""
        call = self._open
        assert call is not None
        self._open = None
        self._advance(call, events, done=True)
        if not call.started:
            events.append(ContentDelta(HERMES_OPEN + call.body + (HERMES_CLOSE if closed else "")))
        elif call.args_start is None:
            events.append(ArgumentsDelta(call.index, "{}"))

    def _advance(
        self, call: _OpenCall, events: list[StreamEvent], done: bool, visible: int | None = None
    ) -> None:
        """Start the call once its name is known; send its arguments as far as is safe
        (within ``body[:visible]``)."""
        body = call.body[:visible]
        if not call.started:
            name = _NAME.search(body)
            if name is None:
                return
            call.started = True
            self.calls += 1
            events.append(CallStart(call.index, new_call_id(), json.loads(f'"{name.group(1)}"')))
        if call.args_start is None:
            key = _ARGS_KEY.search(body)
            if key is None or key.end() >= len(body):
                return
            call.args_start = key.end()
        raw = body[call.args_start :]
        if not raw.startswith("{"):
            self._send_whole_arguments(call, events, done)
            return
        tail = _OBJECT_TAIL.search(raw)
        end = tail.start() if tail is not None else len(raw)
        if end > call.args_sent:
            events.append(ArgumentsDelta(call.index, raw[call.args_sent : end]))
            call.args_sent = end

    @staticmethod
    def _send_whole_arguments(call: _OpenCall, events: list[StreamEvent], done: bool) -> None:
        """Arguments written as a JSON string (not an object): sent once, decoded, at the end."""
        if not done:
            return
        try:
            parsed = call_from_object(json.loads(call.body))
        except json.JSONDecodeError:
            parsed = None
        if parsed is not None:
            events.append(ArgumentsDelta(call.index, parsed.arguments))


class Llama3JsonStream:
    def __init__(self) -> None:
        self.calls = 0
        self._text = ""
        self._is_call: bool | None = None  # decided by the first non-space character

    def feed(self, text: str) -> list[StreamEvent]:
        if self._is_call is False:
            return [ContentDelta(text)] if text else []
        self._text += text
        head = self._text.lstrip()
        if not head or LLAMA3_PYTHON_TAG.startswith(head):
            return []  # too early to tell
        self._is_call = head.startswith(("{", LLAMA3_PYTHON_TAG))
        if self._is_call:
            return []
        out, self._text = self._text, ""
        return [ContentDelta(out)]

    def finish(self) -> list[StreamEvent]:
        if not self._is_call:
            return [ContentDelta(self._text)] if self._text else []
        parsed = parse_llama3_json(self._text)
        if not parsed.calls:
            return [ContentDelta(self._text)]
        events: list[StreamEvent] = []
        for index, call in enumerate(parsed.calls):
            events += [CallStart(index, call.id, call.name), ArgumentsDelta(index, call.arguments)]
        self.calls = len(parsed.calls)
        return events


def tool_call_stream(fmt: ToolCallFormat) -> ToolCallStream:
    if fmt is ToolCallFormat.HERMES:
        return HermesStream()
    return Llama3JsonStream()
