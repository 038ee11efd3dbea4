"""``pdd.common.tracing``: configuration from flags and OTEL_* variables, the context
carried between processes, and the OTLP JSON lines file (issue 58)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdd.common import tracing

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _off() -> Iterator[None]:
    yield
    tracing.shutdown()


def test_flag_endpoint_gets_the_traces_path_and_beats_the_environment() -> None:
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://env:4318/v1/traces"}
    config = tracing.config_from("pdd-router", "http://127.0.0.1:4318", env=env)
    assert config.endpoint == "http://127.0.0.1:4318/v1/traces"
    assert tracing.config_from("pdd-router", env=env).endpoint == "http://env:4318/v1/traces"
    base = {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4318/"}
    assert tracing.config_from("x", env=base).endpoint == "https://collector:4318/v1/traces"


def test_grpc_keeps_the_endpoint_as_given() -> None:
    env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    config = tracing.config_from("x", "http://collector:4317", env=env)
    assert (config.protocol, config.endpoint) == ("grpc", "http://collector:4317")


def test_service_name_env_wins_and_sdk_disabled_turns_it_off(tmp_path: Path) -> None:
    env = {"OTEL_SERVICE_NAME": "mine", "OTEL_SDK_DISABLED": "true"}
    config = tracing.config_from("pdd-main", "http://c:4318", tmp_path / "t.jsonl", env=env)
    assert config.service_name == "mine"
    assert not config.enabled
    assert not tracing.config_from("pdd-main", env={}).enabled
    assert tracing.config_from("x", env={tracing.TRACES_FILE_ENV: "/t.jsonl"}).enabled
    no_export = {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}
    assert tracing.config_from("x", env=no_export).endpoint is None


@pytest.mark.parametrize(
    ("endpoint", "env"),
    [("collector:4318", {}), ("http://c:4318", {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})],
)
def test_bad_settings_are_refused_in_words(endpoint: str, env: dict[str, str]) -> None:
    with pytest.raises(tracing.TracingConfigError, match="OTLP"):
        tracing.config_from("x", endpoint, env=env)


def test_off_costs_no_span_and_carries_nothing() -> None:
    with tracing.span("pdd.request") as span:
        assert not span.is_recording()
        assert tracing.carrier() == {}
    assert tracing.extract({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is None


def test_spans_join_the_callers_trace_and_land_as_otlp_json(tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    tracing.configure(tracing.config_from("pdd-prefill", file=path, env={}))
    client = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    with tracing.span("pdd.kv_transfer", client, {"pdd.kv.codec": "int8"}):
        sent = tracing.carrier()
    with tracing.span("pdd.kv_import", {"bogus": "x"}):  # no context in it: a new root
        pass
    with tracing.span("pdd.kv_import", sent):
        pass
    assert tracing.flush()
    lines = path.read_text().splitlines()
    spans = [
        (rs["resource"], s)
        for line in lines
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for s in ss["spans"]
    ]
    by_name = {}
    for resource, s in spans:
        by_name.setdefault(s["name"], []).append(s)
        names = {a["key"]: a["value"] for a in resource["attributes"]}
        assert names["service.name"] == {"stringValue": "pdd-prefill"}
    (transfer,) = by_name["pdd.kv_transfer"]
    assert transfer["traceId"] == "0af7651916cd43dd8448eb211c80319c"  # hex, not base64
    assert transfer["parentSpanId"] == "b7ad6b7169203331"
    child = next(s for s in by_name["pdd.kv_import"] if s.get("parentSpanId"))
    assert (child["traceId"], child["parentSpanId"]) == (transfer["traceId"], transfer["spanId"])
    assert sent["traceparent"].split("-")[2] == transfer["spanId"]
