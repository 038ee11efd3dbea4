"""Tool calls read out of an output while it streams, as the OpenAI SDK accumulates them.

The SDK builds each call from ``delta.tool_calls`` entries keyed by ``index``: the first
entry of a call carries ``id``, ``type`` and the function's ``name``; later ones append
to ``function.arguments``. So a stream parser turns text deltas into three events:
content, a call's start (once its name is known) and a piece of its arguments.

Hermes (``<tool_call>`` blocks): text outside the blocks streams as content, except a
tail that may be the start of ``<tool_call>`` (held back until the next text decides,
so no tag fragment ever reaches the client as content); inside a block the arguments
stream as the model writes them, holding back only what may be the call object's own
closing brace. Llama-3 JSON (``;``-separated call objects, maybe after
``<|python_tag|>``): each object is read as it arrives, so a call starts as soon as its
``name`` is known and its arguments object streams as the model writes it; an output
that shows no call streams as content.
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


@dataclass
class _ObjectScan:
    """The top level of one JSON object as far as it has been read, one character at a
    time: where its ``name`` and arguments values are, and where it ends. Strings (and
    their escapes) and nesting are tracked, so a brace or a ``"name"`` key inside the
    arguments or inside a string is never taken for the call's own."""

    start: int  # the object's "{" in the output
    depth: int = 1
    in_string: bool = False
    escaped: bool = False
    string_start: int = 0
    want: str = "key"  # at depth 1: key, colon, value, or after (a value began)
    key: str | None = None
    name: str | None = None
    args_start: int | None = None  # the arguments object's "{", when they are an object
    args_end: int | None = None
    end: int | None = None  # one past the object's closing "}"

    def scan(self, text: str, at: int) -> None:
        """Read ``text[at]``."""
        c = text[at]
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
                if self.depth == 1:
                    self._string_read(_json_string(text[self.string_start : at + 1]))
            return
        if self.depth == 1 and self.want == "value" and not c.isspace():
            self._value_starts(c, at)
        if c == '"':
            self.in_string, self.string_start = True, at
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 1 and self.args_start is not None and self.args_end is None:
                self.args_end = at + 1
            if self.depth == 0:
                self.end = at + 1
        elif self.depth == 1 and c == ":" and self.want == "colon":
            self.want = "value"
        elif self.depth == 1 and c == ",":
            self.want = "key"

    def _value_starts(self, c: str, at: int) -> None:
        self.want = "after"
        if c == "{" and self.key in _ARGUMENT_KEYS and self.args_start is None:
            self.args_start = at

    def _string_read(self, value: str | None) -> None:
        if self.want == "key":
            self.key, self.want = value, "colon"
        elif self.want == "after" and self.key == "name" and self.name is None:
            self.name = value


def _json_string(literal: str) -> str | None:
    """A JSON string literal's value; None for a broken one (a bad escape), which names
    nothing and leaves the object to the whole-object check."""
    try:
        value = json.loads(literal)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


_ARGUMENT_KEYS = ("arguments", "parameters")
_SEPARATORS = " \t\r\n;"


class Llama3JsonStream:
    """Llama-3 JSON calls as they are written: a call starts once its object's ``name``
    has been read, and its arguments object streams as it arrives (arguments written
    as a JSON string, or not at all, are sent when the object closes).

    The output is undecided until it shows a call: leading space and ``<|python_tag|>``
    are held, and an output that turns out not to be calls (no ``{`` first, an object
    that closes without naming a function) goes out whole as content, as the
    non-streaming parse reads it. A call already sent cannot be taken back: text that
    breaks the format after one (a stray word, a cut-off object) streams as content
    after it, where the whole-output parse would call all of it content (as vLLM's
    streaming parsers do too). A grammar-forced call is always whole.
    """

    def __init__(self) -> None:
        self.calls = 0
        self._text = ""
        self._pos = 0  # the next character to read
        #: lead (space, python tag), tagged (after the tag), object, gap (between), content
        self._phase = "lead"
        self._object: _ObjectScan | None = None
        self._started = False  # the current object's call was sent
        self._args_sent = 0  # of the current call's arguments object

    def feed(self, text: str) -> list[StreamEvent]:
        if self._phase == "content":
            return [ContentDelta(text)] if text else []
        self._text += text
        events: list[StreamEvent] = []
        while self._pos < len(self._text) and self._phase != "content":
            if self._phase == "object":
                self._read_object(events)
            elif not self._between_objects(events):
                break  # a partial python tag: wait for more
        return events

    def finish(self) -> list[StreamEvent]:
        """The output ended: held text that showed no call is content; a cut-off object
        whose call was sent stays as far as it came."""
        events: list[StreamEvent] = []
        if self._phase in ("lead", "tagged") and self._text:
            self._to_content(0, events)
        elif self._phase == "object" and not self._started:
            assert self._object is not None
            self._to_content(self._object.start, events)
        return events

    def _between_objects(self, events: list[StreamEvent]) -> bool:
        """Before the first object, or after one: skip what may separate calls; returns
        False while the text may still be the python tag."""
        text, at = self._text, self._pos
        allowed = _SEPARATORS if self._phase == "gap" else _SEPARATORS.replace(";", "")
        while at < len(text) and text[at] in allowed:
            at += 1
        self._pos = at
        rest = text[at:]
        if self._phase == "lead" and at < len(text) and LLAMA3_PYTHON_TAG.startswith(rest):
            return False
        if self._phase == "lead" and rest.startswith(LLAMA3_PYTHON_TAG):
            self._pos = at + len(LLAMA3_PYTHON_TAG)
            self._phase = "tagged"
        elif rest.startswith("{"):
            self._object, self._started, self._args_sent = _ObjectScan(at), False, 0
            self._phase, self._pos = "object", at + 1
        elif rest:
            self._to_content(at, events)
        return True

    def _read_object(self, events: list[StreamEvent]) -> None:
        """Read what has arrived of the current object and send what it makes known."""
        scan = self._object
        assert scan is not None
        while self._pos < len(self._text) and scan.end is None:
            scan.scan(self._text, self._pos)
            self._pos += 1
        if scan.name is not None and not self._started:
            self._started = True
            events.append(CallStart(self.calls, new_call_id(), scan.name))
            self.calls += 1
        if self._started and scan.args_start is not None:
            end = scan.args_end if scan.args_end is not None else self._pos
            piece = self._text[scan.args_start + self._args_sent : end]
            if piece:
                events.append(ArgumentsDelta(self.calls - 1, piece))
                self._args_sent += len(piece)
        if scan.end is not None:
            self._close(scan, events)

    def _close(self, scan: _ObjectScan, events: list[StreamEvent]) -> None:
        """The object closed: arguments not streamed go out whole; an object that named
        no function makes the output content."""
        self._phase = "gap"
        if not self._started:
            self._to_content(scan.start, events)
        elif scan.args_start is None:
            try:
                call = call_from_object(json.loads(self._text[scan.start : scan.end]))
            except json.JSONDecodeError:
                call = None
            events.append(ArgumentsDelta(self.calls - 1, call.arguments if call else "{}"))

    def _to_content(self, at: int, events: list[StreamEvent]) -> None:
        """The rest is content: all of the output while no call was sent, else from
        ``at``, where the format broke."""
        text = self._text[0 if self.calls == 0 else at :]
        if text:
            events.append(ContentDelta(text))
        self._phase = "content"


def tool_call_stream(fmt: ToolCallFormat) -> ToolCallStream:
    if fmt is ToolCallFormat.HERMES:
        return HermesStream()
    return Llama3JsonStream()
