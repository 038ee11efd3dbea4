"""``pdd trace``: one request's waterfall in the terminal, from OTLP JSON spans.

Reads the spans every process of a ``pdd up`` stack appends to ``pdd-logs/traces.jsonl``
(``--from`` another file: any OTLP JSON lines, the Collector's file exporter's too),
picks one trace by its id or by the router's request id (``x-pdd-request-id``; a
recovered request's later attempts, ``ID-rN``, are in the same trace), and draws each
span as a bar on one time axis, nested under its parent, with what matters of it: the
route's pipeline and reason, a KV transfer's path, codec and bytes, a handoff's tokens.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdd.common.settings import parser as settings_parser
from pdd.common.tracing import REQUEST_ID, TRACES_FILE

_TRACE_ID = re.compile(r"^[0-9a-f]{32}$")
#: The attributes shown beside a span, in this order, under these short names.
DETAILS = (
    ("pdd.pipeline", "pipeline"), ("pdd.reason_code", "reason"), ("pdd.kv.path", "path"),
    ("pdd.kv.peer", "to"), ("pdd.kv.codec", "codec"), ("pdd.kv.wire_bytes", "bytes"),
    ("pdd.hit_tokens", "hit"), ("pdd.cached_tokens", "cached"),
    ("pdd.handoff.tokens", "handed"), ("pdd.handoff.rounds", "rounds"),
    ("pdd.extend.tokens", "extend"),
    ("pdd.streamed_tokens", "streamed"), ("pdd.finish_reason", "finish"),
    ("http.response.status_code", "status"),
)  # fmt: skip


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
        for rs in doc.get("resourceSpans", []) if isinstance(doc, dict) else []:
            resource = _attributes(rs.get("resource", {}).get("attributes", []))
            service = str(resource.get("service.name", "?"))
            for ss in rs.get("scopeSpans", []):
                for s in ss.get("spans", []):
                    yield SpanRecord(
                        trace_id=s["traceId"], span_id=s["spanId"],
                        parent_id=s.get("parentSpanId") or None, name=s.get("name", "?"),
                        service=service, start_ns=int(s["startTimeUnixNano"]),
                        end_ns=int(s["endTimeUnixNano"]),
                        attributes=_attributes(s.get("attributes", [])),
                        events=[e.get("name", "?") for e in s.get("events", [])],
                    )  # fmt: skip


def select(spans: list[SpanRecord], key: str) -> list[SpanRecord]:
    """The spans of the trace ``key`` names: a trace id (32 hex digits), or a request id
    some span carries (``pdd.request_id``, or an attempt of it: ``ID-rN``)."""
    if _TRACE_ID.match(key):
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


def ordered(spans: list[SpanRecord]) -> list[tuple[int, SpanRecord]]:
    """(depth, span) depth-first, children by start time; a span whose parent is not
    among them (the client's, or one not exported yet) is a root."""
    ids = {s.span_id for s in spans}
    children: dict[str | None, list[SpanRecord]] = {}
    for s in spans:
        children.setdefault(s.parent_id if s.parent_id in ids else None, []).append(s)
    out: list[tuple[int, SpanRecord]] = []

    def walk(parent: str | None, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda x: x.start_ns):
            out.append((depth, s))
            walk(s.span_id, depth + 1)

    walk(None, 0)
    return out


def details(span: SpanRecord) -> str:
    """What the waterfall prints beside a span (its key attributes and events)."""
    parts = [f"{short}={span.attributes[k]}" for k, short in DETAILS if k in span.attributes]
    parts += [f"!{e}" for e in span.events]
    return " ".join(parts)


def bar(start_ns: int, end_ns: int, t0: int, t1: int, width: int) -> str:
    """The span as a bar of ``width`` columns on the axis ``[t0, t1]``; at least one
    column, so a short span still shows where it lies."""
    scale = width / max(1, t1 - t0)
    left = min(width - 1, int((start_ns - t0) * scale))
    right = max(left + 1, min(width, round((end_ns - t0) * scale)))
    return " " * left + "█" * (right - left) + " " * (width - right)


def waterfall(spans: list[SpanRecord], width: int = 40) -> Any:
    """A rich table: span (indented), service, start and duration in ms, bar, details."""
    from rich.table import Table

    rows = ordered(spans)
    t0 = min(s.start_ns for s in spans)
    t1 = max(s.end_ns for s in spans)
    table = Table(title=f"trace {spans[0].trace_id}  ({(t1 - t0) / 1e6:.1f} ms)", expand=False)
    for column in ("span", "service", "start ms", "ms", "", "details"):
        table.add_column(column, no_wrap=column != "details")
    for depth, s in rows:
        table.add_row(
            "  " * depth + s.name, s.service, f"{(s.start_ns - t0) / 1e6:.1f}",
            f"{s.duration_ms:.1f}", bar(s.start_ns, s.end_ns, t0, t1, width), details(s),
        )  # fmt: skip
    return table


def build_parser() -> argparse.ArgumentParser:
    p = settings_parser("pdd trace", __doc__.splitlines()[0])
    p.add_argument("key", metavar="REQUEST_ID|TRACE_ID", help="x-pdd-request-id or a trace id")
    p.add_argument(
        "--from", dest="source", type=Path, default=Path("pdd-logs") / TRACES_FILE,
        help="OTLP JSON lines to read (default: pdd-logs/traces.jsonl, what `pdd up` writes)",
    )  # fmt: skip
    p.add_argument("--width", type=int, default=40, help="the time axis' width, in columns")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        with args.source.open(encoding="utf-8") as f:
            spans = select(list(parse_lines(f)), args.key)
    except OSError as exc:
        print(f"pdd trace: cannot read {args.source}: {exc.strerror}", file=sys.stderr)
        return 2
    except TraceNotFound as exc:
        print(f"pdd trace: {exc} in {args.source}", file=sys.stderr)
        return 1
    from rich.console import Console

    # Piped (no terminal), rich would squeeze the table into 80 columns.
    Console(width=None if sys.stdout.isatty() else 200).print(waterfall(spans, max(10, args.width)))
    return 0
