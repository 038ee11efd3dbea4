"""One trace's spans, as ``pdd trace`` reads them: OTLP JSON (a file's lines, a Tempo
answer) into ``SpanRecord``s, and the choice of one trace by its id or a request id.

Its own module so that the readers of every source (``trace_view``'s file,
``trace_query``'s backends) share one model and one parser.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pdd.common.tracing import REQUEST_ID

_TRACE_ID = re.compile(r"^[0-9a-f]{32}$")
_HEX = re.compile(r"^[0-9a-fA-F]+$")


@dataclass
class SpanRecord:
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


class TraceNotFound(LookupError):
    pass


def _value(v: dict[str, Any]) -> Any:
    """An OTLP ``AnyValue`` as Python."""
    for key in ("stringValue", "boolValue", "doubleValue"):
        if key in v:
            return v[key]
    if "intValue" in v:
        return int(v["intValue"])
    if "arrayValue" in v:
        return [_value(x) for x in v["arrayValue"].get("values", [])]
    return None


def _attributes(items: Iterable[dict[str, Any]]) -> dict[str, Any]:
    return {a["key"]: _value(a.get("value", {})) for a in items}


def parse_lines(lines: Iterable[str]) -> Iterator[SpanRecord]:
    """Every span of OTLP JSON lines (``{"resourceSpans": [...]}`` each); lines that
    are not such JSON are skipped (a line cut short by a process killed mid-write)."""
    for line in lines:
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            yield from parse_otlp(doc.get("resourceSpans", []))


def parse_otlp(resource_spans: list[dict[str, Any]]) -> Iterator[SpanRecord]:
    """The spans of OTLP JSON ``ResourceSpans`` (a file's line, a Tempo answer's ``batches``).
    Ids may be hex (OTLP JSON, the Collector) or base64 (protobuf's JSON mapping, which
    Tempo answers with); older writers call the scopes ``instrumentationLibrarySpans``."""
    for rs in resource_spans:
        resource = _attributes(rs.get("resource", {}).get("attributes", []))
        service = str(resource.get("service.name", "?"))
        for ss in rs.get("scopeSpans") or rs.get("instrumentationLibrarySpans") or []:
            for s in ss.get("spans", []):
                yield SpanRecord(
                    trace_id=hex_id(s["traceId"], 32), span_id=hex_id(s["spanId"], 16),
                    parent_id=hex_id(s["parentSpanId"], 16) if s.get("parentSpanId") else None,
                    name=s.get("name", "?"), service=service,
                    start_ns=int(s["startTimeUnixNano"]), end_ns=int(s["endTimeUnixNano"]),
                    attributes=_attributes(s.get("attributes", [])),
                    events=[e.get("name", "?") for e in s.get("events", [])],
                )  # fmt: skip


def hex_id(value: str, digits: int) -> str:
    """A trace (32 digits) or span (16) id as lower-case hex: from hex, hex short of its
    leading zeros (as Jaeger and Tempo print ids) or base64 (protobuf's JSON mapping, as
    Tempo answers: 24 or 12 characters, padded, so never all hex digits); anything else
    as it is."""
    if _HEX.match(value):
        return value.lower().rjust(digits, "0")
    if len(value) == 4 * -(-digits // 6):  # base64 of digits / 2 bytes, padded
        try:
            return base64.b64decode(value, validate=True).hex()
        except ValueError:
            pass
    return value


def is_trace_id(key: str) -> bool:
    """A trace id (32 lower-case hex digits), as opposed to a request id."""
    return bool(_TRACE_ID.match(key))


def select(spans: list[SpanRecord], key: str) -> list[SpanRecord]:
    """The spans of the trace ``key`` names: a trace id (32 hex digits), or a request id
    some span carries (``pdd.request_id``, or an attempt of it: ``ID-rN``)."""
    if is_trace_id(key):
        chosen = {key}
    else:
        chosen = {
            s.trace_id for s in spans
            if (rid := str(s.attributes.get(REQUEST_ID, ""))) == key or rid.startswith(f"{key}-r")
        }  # fmt: skip
    found = [s for s in spans if s.trace_id in chosen]
    if not found:
        raise TraceNotFound(f"no span of trace or request {key!r}")
    return found
