"""``pdd trace``: OTLP JSON lines to one request's waterfall (issue 58)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from pdd.local import trace_view

pytestmark = pytest.mark.unit

T1, T2 = "a" * 32, "b" * 32


def _span(trace: str, sid: str, parent: str | None, name: str, t0: int, t1: int,
          **attrs: object) -> dict:  # fmt: skip
    s = {"traceId": trace, "spanId": sid, "name": name, "kind": 1,
         "startTimeUnixNano": str(t0 * 10**6), "endTimeUnixNano": str(t1 * 10**6),
         "attributes": [{"key": k, "value": {"intValue": str(v)} if isinstance(v, int)
                         else {"stringValue": str(v)}} for k, v in attrs.items()]}  # fmt: skip
    if parent:
        s["parentSpanId"] = parent
    return s


def _line(service: str, *spans: dict) -> str:
    resource = {"attributes": [{"key": "service.name", "value": {"stringValue": service}}]}
    scope = {"spans": list(spans)}
    return json.dumps({"resourceSpans": [{"resource": resource, "scopeSpans": [scope]}]})


LINES = [
    _line("pdd-router",
          _span(T1, "r1", None, "pdd.request", 0, 100, **{"pdd.request_id": "pdd-x"}),
          _span(T1, "r2", "r1", "pdd.route", 1, 3, **{"pdd.pipeline": "P-RLD-MD"})),
    "not json, a line cut short",
    _line("pdd-prefill",
          _span(T1, "p1", "r1", "pdd.kv_transfer", 10, 40,
                **{"pdd.kv.codec": "int8", "pdd.kv.wire_bytes": 4096,
                   "pdd.request_id": "pdd-x-r1"})),
    _line("pdd-router", _span(T2, "o1", None, "pdd.request", 0, 5, **{"pdd.request_id": "pdd-y"})),
]  # fmt: skip


def test_a_request_id_or_its_attempts_pick_its_trace_only() -> None:
    spans = list(trace_view.parse_lines(LINES))
    assert len(spans) == 4
    assert {s.trace_id for s in trace_view.select(spans, "pdd-x")} == {T1}
    assert [s.name for s in trace_view.select(spans, T2)] == ["pdd.request"]
    with pytest.raises(trace_view.TraceNotFound):
        trace_view.select(spans, "pdd-nope")


def test_spans_nest_under_their_parents_by_start() -> None:
    spans = trace_view.select(list(trace_view.parse_lines(LINES)), "pdd-x")
    order = [(depth, s.name) for depth, s in trace_view.ordered(spans)]
    assert order == [(0, "pdd.request"), (1, "pdd.route"), (1, "pdd.kv_transfer")]


def test_bars_share_one_axis_and_show_short_spans() -> None:
    assert trace_view.bar(0, 100, 0, 100, 10) == "█" * 10
    assert trace_view.bar(10, 40, 0, 100, 10) == " " + "█" * 3 + " " * 6
    assert trace_view.bar(50, 50, 0, 100, 10).count("█") == 1  # instantaneous, still drawn


def test_the_waterfall_names_codec_bytes_and_pipeline() -> None:
    spans = trace_view.select(list(trace_view.parse_lines(LINES)), "pdd-x")
    console = Console(width=200, record=True)
    console.print(trace_view.waterfall(spans, 20))
    text = console.export_text()
    assert "codec=int8 bytes=4096" in text
    assert "pipeline=P-RLD-MD" in text
    assert "pdd-prefill" in text


def test_main_says_what_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "traces.jsonl"
    path.write_text("\n".join(LINES) + "\n")
    assert trace_view.main(["pdd-nope", "--from", str(path)]) == 1
    assert "no span of trace or request 'pdd-nope'" in capsys.readouterr().err
    assert trace_view.main(["pdd-x", "--from", str(tmp_path / "absent")]) == 2
    assert trace_view.main(["pdd-x", "--from", str(path)]) == 0
    assert "pdd.kv_transfer" in capsys.readouterr().out
