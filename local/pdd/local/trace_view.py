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
import sys
from pathlib import Path
from typing import Any

from pdd.common.settings import parser as settings_parser
from pdd.common.tracing import TRACES_FILE
from pdd.local.trace_query import Backend, TraceQueryError, fetch
from pdd.local.trace_spans import SpanRecord, TraceNotFound, parse_lines, select

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
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--from", dest="source", type=Path, default=Path("pdd-logs") / TRACES_FILE,
        help="OTLP JSON lines to read (default: pdd-logs/traces.jsonl, what `pdd up` writes)",
    )  # fmt: skip
    where.add_argument(
        "--jaeger", metavar="URL",
        help="ask this Jaeger query service (http://HOST:16686) instead of reading a file",
    )  # fmt: skip
    where.add_argument(
        "--tempo", metavar="URL",
        help="ask this Tempo's HTTP API (http://HOST:3200) instead of reading a file",
    )  # fmt: skip
    p.add_argument(
        "--service", default="pdd-router",
        help="with --jaeger and a request id: the service whose spans carry it (the "
        "router's OTEL_SERVICE_NAME; default: pdd-router)",
    )  # fmt: skip
    p.add_argument(
        "--lookback-hours", type=float, default=24.0,
        help="with --jaeger or --tempo and a request id: how far back to search (default: 24)",
    )  # fmt: skip
    p.add_argument("--width", type=int, default=40, help="the time axis' width, in columns")
    return p


def _spans(args: argparse.Namespace) -> list[SpanRecord]:
    """The chosen trace's spans, from the backend or the file the flags name."""
    if args.jaeger or args.tempo:
        backend, url = (Backend.JAEGER, args.jaeger) if args.jaeger else (Backend.TEMPO, args.tempo)
        spans = fetch(backend, url, args.key, args.service, args.lookback_hours * 3600)
        return select(spans, args.key)
    with args.source.open(encoding="utf-8") as f:
        return select(list(parse_lines(f)), args.key)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.lookback_hours <= 0:
        print("pdd trace: --lookback-hours must be more than 0", file=sys.stderr)
        return 2
    try:
        spans = _spans(args)
    except OSError as exc:
        print(f"pdd trace: cannot read {args.source}: {exc.strerror}", file=sys.stderr)
        return 2
    except TraceQueryError as exc:
        print(f"pdd trace: {exc}", file=sys.stderr)
        return 2
    except TraceNotFound as exc:  # a backend's message names it; a file's does not
        where = "" if args.jaeger or args.tempo else f" in {args.source}"
        print(f"pdd trace: {exc}{where}", file=sys.stderr)
        return 1
    from rich.console import Console

    # Piped (no terminal), rich would squeeze the table into 80 columns.
    Console(width=None if sys.stdout.isatty() else 200).print(waterfall(spans, max(10, args.width)))
    return 0
