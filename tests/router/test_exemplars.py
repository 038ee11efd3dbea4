"""The TTFT and ITL histograms carry the request's trace id as an OpenMetrics exemplar
(issue 58), so a dashboard's slow bucket links to a trace: shown where the scraper asks
for OpenMetrics (Prometheus does, with exemplar storage on), never in the classic text
format, which has no syntax for it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from pdd.common import tracing
from pdd.router.generation import _exemplar
from pdd.router.metrics import RouterMetrics

pytestmark = pytest.mark.unit

OPENMETRICS = "application/openmetrics-text; version=1.0.0,text/plain;version=0.0.4;q=0.5"


@pytest.fixture
def traced(tmp_path: Path) -> Iterator[None]:
    tracing.configure(tracing.config_from("pdd-router", file=tmp_path / "t.jsonl", env={}))
    yield
    tracing.shutdown()


def _exemplars(text: str, family: str) -> dict[str, str]:
    """``le`` -> the trace id of each bucket's exemplar, in one histogram family."""
    (hist,) = [f for f in text_string_to_metric_families(text) if f.name == family]
    return {
        s.labels["le"]: s.exemplar.labels["trace_id"]
        for s in hist.samples
        if s.name.endswith("_bucket") and s.exemplar is not None
    }


def test_a_traced_requests_ttft_and_itl_link_to_its_trace(traced: None) -> None:
    metrics = RouterMetrics()
    with tracing.span("pdd.request") as span:
        exemplar = _exemplar()
        trace_id = tracing.trace_id_hex(span)
    assert exemplar == {"trace_id": trace_id}
    metrics.ttft.observe(0.3, exemplar)
    metrics.itl.observe(0.02, exemplar)
    body, content_type = metrics.exposition(OPENMETRICS)
    assert content_type.startswith("application/openmetrics-text")
    text = body.decode()
    assert _exemplars(text, "pdd_router_ttft_seconds") == {"0.5": trace_id}
    assert _exemplars(text, "pdd_router_itl_seconds") == {"0.025": trace_id}


def test_the_classic_format_stays_what_it_was(traced: None) -> None:
    metrics = RouterMetrics()
    with tracing.span("pdd.request"):
        metrics.ttft.observe(0.3, _exemplar())
    for accept in ("", "text/plain", "*/*"):
        body, content_type = metrics.exposition(accept)
        assert content_type.startswith("text/plain; version=0.0.4")
        assert body == metrics.render() and b"trace_id" not in body


def test_untraced_requests_carry_no_exemplar() -> None:
    assert _exemplar() is None
