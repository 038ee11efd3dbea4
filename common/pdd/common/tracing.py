"""OpenTelemetry tracing for every PDD process: one trace per request, router to MD.

Each process calls ``configure`` once at start-up (``add_tracing_flags`` gives it the
flags); from then on ``span`` opens a span under the current one, or under a parent
taken from a carrier (``extract``: a request's ``traceparent`` header, the
``PipelinePlan.trace_context`` a worker receives, a data channel's handshake META), and
``carrier`` gives the current span's W3C context to send on.

Configuration is what the ecosystem expects: ``--otlp-traces-endpoint`` (vLLM's flag),
else ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``, the
protocol from ``OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL`` (``http/protobuf``, the default,
or ``grpc``), ``OTEL_SERVICE_NAME`` over the role's own name, ``OTEL_RESOURCE_ATTRIBUTES``
and ``OTEL_TRACES_SAMPLER[_ARG]`` read by the SDK, ``OTEL_SDK_DISABLED=true`` to switch
it off. ``--traces-file`` (or ``$PDD_TRACES_FILE``; ``pdd up`` sets it) appends OTLP JSON
lines, which ``pdd trace`` reads.

Spans leave through a batch processor on its own thread: never on a request's critical
path. A full queue drops spans; they are counted (``pdd_router_trace_spans_dropped_total``,
``pdd_worker_...``: ``register_metrics``) rather than waited for.

The provider is this module's own, never the global one: FastAPI traces every request
and every dependency of its own accord once a global provider is set, spans nobody asked
for on the router's hot path. With tracing off, ``span`` is a ``nullcontext``: no span
objects, no context switches.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

log = logging.getLogger(__name__)

#: The W3C header (and carrier key) that names a span's trace and parent.
TRACEPARENT = "traceparent"
#: The environment variable ``pdd up`` sets so every pod appends spans to one file.
TRACES_FILE_ENV = "PDD_TRACES_FILE"
#: The file's name in ``pdd up``'s log folder.
TRACES_FILE = "traces.jsonl"
#: OTLP's path for traces over HTTP, added to an endpoint given without a path.
OTLP_HTTP_TRACES_PATH = "/v1/traces"
PROTOCOLS = ("http/protobuf", "grpc")
#: The span attribute naming the router's request id (``x-pdd-request-id``).
REQUEST_ID = "pdd.request_id"

_PROPAGATOR = TraceContextTextMapPropagator()


class TracingConfigError(ValueError):
    """A tracing setting that cannot work (an unknown protocol, an endpoint with no host)."""


@dataclass(frozen=True)
class TracingConfig:
    """Where spans go and what the process calls itself."""

    service_name: str
    endpoint: str | None = None
    protocol: str = "http/protobuf"
    file: Path | None = None
    #: Resource attributes beside ``service.name`` (role, datacenter, instance).
    attributes: Mapping[str, str] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None or self.file is not None


def config_from(
    service_name: str,
    endpoint: str | None = None,
    file: Path | None = None,
    attributes: Mapping[str, str] | None = None,
    env: Mapping[str, str] = os.environ,
) -> TracingConfig:
    """The process's tracing: flags first (``endpoint``, ``file``), then the standard
    ``OTEL_*`` variables; ``service_name`` is the role's own, which ``OTEL_SERVICE_NAME``
    replaces. Raises ``TracingConfigError`` for settings that cannot work."""
    attrs = dict(attributes or {})
    name = env.get("OTEL_SERVICE_NAME") or service_name
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return TracingConfig(name, attributes=attrs)
    exporter = env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol not in PROTOCOLS:
        raise TracingConfigError(
            f"OTLP protocol {protocol!r} is not one PDD exports with; use one of {PROTOCOLS}"
        )
    url = endpoint
    if url is None and exporter != "none":
        base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        url = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or base
    if url is not None:
        url = _traces_url(url, protocol)
    file = file or (Path(env[TRACES_FILE_ENV]) if env.get(TRACES_FILE_ENV) else None)
    return TracingConfig(name, url, protocol, file, attrs)


def _traces_url(url: str, protocol: str) -> str:
    """The exporter's URL: OTLP/HTTP's traces path added where ``url`` has no path (as
    the SDK does for ``OTEL_EXPORTER_OTLP_ENDPOINT``; vLLM's flag takes the bare base)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TracingConfigError(
            f"OTLP traces endpoint {url!r} must be an http:// or https:// URL with a host"
        )
    if protocol == "http/protobuf" and parts.path in ("", "/"):
        return url.rstrip("/") + OTLP_HTTP_TRACES_PATH
    return url


def add_tracing_flags(p: argparse.ArgumentParser) -> None:
    """``--otlp-traces-endpoint`` (vLLM's name) and ``--traces-file``."""
    p.add_argument(
        "--otlp-traces-endpoint",
        help="send OpenTelemetry spans over OTLP to this URL (http/protobuf by default; "
        "OTEL_EXPORTER_OTLP_* and OTEL_TRACES_SAMPLER* are honoured too)",
    )
    p.add_argument(
        "--traces-file",
        type=Path,
        help=f"append spans to this file as OTLP JSON lines, read by `pdd trace` "
        f"(default: ${TRACES_FILE_ENV}, else none)",
    )


class _State:
    """The process's tracer, or None when tracing is off."""

    tracer: trace.Tracer | None = None
    provider: Any = None
    dropped = 0
    lock = threading.Lock()


def enabled() -> bool:
    return _State.tracer is not None


def configure(config: TracingConfig) -> None:
    """Set up this process's tracer from ``config`` (a no-op tracer where it exports
    nowhere). Called once per process; a second call replaces the first provider."""
    shutdown()
    if not config.enabled:
        return
    # Imported here: a process that does not trace never loads the SDK.
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    from pdd.common.trace_export import CountingBatchSpanProcessor, exporters

    resource = Resource.create({**config.attributes, "service.name": config.service_name})
    provider = TracerProvider(resource=resource)
    for exporter in exporters(config.endpoint, config.protocol, config.file):
        provider.add_span_processor(CountingBatchSpanProcessor(exporter, _count_dropped))
    _State.provider = provider
    _State.tracer = provider.get_tracer("pdd")
    log.info(
        "tracing as %s to %s",
        config.service_name,
        ", ".join(filter(None, (config.endpoint, str(config.file) if config.file else None))),
    )


def configure_from_args(
    args: argparse.Namespace, service_name: str, attributes: Mapping[str, str] | None = None
) -> None:
    """``configure`` from ``add_tracing_flags``'s flags and the environment."""
    configure(config_from(service_name, args.otlp_traces_endpoint, args.traces_file, attributes))


def shutdown() -> None:
    """Flush and stop the exporters (at exit; tests that configure more than once)."""
    provider, _State.provider, _State.tracer = _State.provider, None, None
    if provider is not None:
        provider.shutdown()


def flush(timeout_s: float = 5.0) -> bool:
    """Export every ended span now (True when all went out in time)."""
    provider = _State.provider
    return True if provider is None else bool(provider.force_flush(int(timeout_s * 1000)))


def _count_dropped(n: int) -> None:
    with _State.lock:
        _State.dropped += n


def dropped_spans() -> int:
    """Spans dropped so far because the export queue was full."""
    return _State.dropped


class _DroppedCollector(Collector):
    def __init__(self, prefix: str) -> None:
        self._name = f"{prefix}_trace_spans_dropped"

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            self._name,
            "Spans dropped because the exporter's queue was full (never waited for)",
            value=_State.dropped,
        )


def register_metrics(registry: CollectorRegistry, prefix: str) -> None:
    """Expose ``<prefix>_trace_spans_dropped_total`` on a process's metrics registry
    (``prefix``: its metrics' own, ``pdd_router`` or ``pdd_worker``)."""
    registry.register(_DroppedCollector(prefix))


def extract(carrier: Mapping[str, str] | None) -> otel_context.Context | None:
    """The context a carrier (headers, a plan's ``trace_context``) names, or None where
    it names none (or tracing is off)."""
    if _State.tracer is None or not carrier:
        return None
    ctx = _PROPAGATOR.extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def carrier(span: Span | None = None) -> dict[str, str]:
    """``{"traceparent": ...}`` of ``span`` (default: the current one); empty when
    tracing is off or there is no span."""
    if _State.tracer is None:
        return {}
    out: dict[str, str] = {}
    ctx = None if span is None else trace.set_span_in_context(span)
    _PROPAGATOR.inject(out, context=ctx)
    return out


Attributes = Mapping[str, str | bool | int | float | Sequence[str] | Sequence[int]]


def span(
    name: str,
    parent: otel_context.Context | Mapping[str, str] | None = None,
    attributes: Attributes | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    start_time_ns: int | None = None,
) -> contextlib.AbstractContextManager[Span]:
    """A span made current for the ``with`` block, under ``parent`` (a context, or a
    carrier to ``extract``) or else the current span; ``INVALID_SPAN`` when tracing is
    off, whose setters do nothing. An exception leaving the block marks it failed."""
    tracer = _State.tracer
    if tracer is None:
        return contextlib.nullcontext(INVALID_SPAN)
    ctx = _parent_context(parent)
    return tracer.start_as_current_span(
        name, context=ctx, kind=kind, attributes=attributes, start_time=start_time_ns
    )


def start_span(
    name: str,
    parent: otel_context.Context | Mapping[str, str] | None = None,
    attributes: Attributes | None = None,
    start_time_ns: int | None = None,
) -> Span:
    """A span the caller ends itself (``span.end()``), for work that outlives one block
    (a transfer, a decode streamed by callbacks); ``INVALID_SPAN`` when tracing is off."""
    tracer = _State.tracer
    if tracer is None:
        return INVALID_SPAN
    ctx = _parent_context(parent)
    return tracer.start_span(name, context=ctx, attributes=attributes, start_time=start_time_ns)


def _parent_context(
    parent: otel_context.Context | Mapping[str, str] | None,
) -> otel_context.Context | None:
    """``parent`` as a context: a carrier is extracted (an OpenTelemetry ``Context`` is a
    dict too, so it is told apart first)."""
    if parent is None or isinstance(parent, otel_context.Context):
        return parent
    return extract(parent)


def context_of(span: Span) -> otel_context.Context | None:
    """A context whose current span is ``span`` (a parent for spans started later)."""
    return None if _State.tracer is None else trace.set_span_in_context(span)


@contextlib.contextmanager
def attached(ctx: otel_context.Context | None) -> Iterator[None]:
    """Make ``ctx`` current for the block (nothing when None)."""
    if ctx is None:
        yield
        return
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


def event(name: str, attributes: Attributes | None = None, on: Span | None = None) -> None:
    """A span event (failover, re-dispatch, drain) on ``on`` or the current span; none on
    a span already ended (a report that came after the request's answer)."""
    if _State.tracer is None:
        return
    target = on or trace.get_current_span()
    if target.is_recording():
        target.add_event(name, attributes=attributes)


def trace_id_hex(span: Span | None = None) -> str | None:
    """The current (or ``span``'s) trace id in hex, None outside a sampled trace."""
    if _State.tracer is None:
        return None
    sc = (span or trace.get_current_span()).get_span_context()
    return format(sc.trace_id, "032x") if sc.is_valid and sc.trace_flags.sampled else None


def set_attributes(attributes: Attributes) -> None:
    """Attributes on the current span (a no-op with tracing off or no span)."""
    if _State.tracer is not None:
        trace.get_current_span().set_attributes(attributes)
