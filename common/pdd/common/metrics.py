"""A component's Prometheus metrics, defined the one way the project names them.

The router and the worker each keep a registry of their own (tests run several in one
process), under one set of conventions (docs/metrics.md): one prefix per component
(``pdd_router``, ``pdd_worker``), base units in the name, no ``_total`` in a name
(prometheus_client appends it to a ``Counter``'s on exposition; a gauge must not look
like a counter), no label Prometheus sets on a scrape (``instance``, ``job``), and the
process's dropped-spans counter (``pdd.common.tracing``). ``ComponentMetrics`` holds
those rules once, so each component states only its own metrics, and a definition that
breaks one fails where the component's metrics are built (every test that builds them),
not later on a dashboard.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import choose_encoder

from pdd.common import tracing

#: Labels Prometheus sets on every series it scrapes (the target's); ours would be renamed.
RESERVED_LABELS = frozenset({"instance", "job"})


class ComponentMetrics:
    """One component's registry (``registry``), whose metrics all start with ``prefix``."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.registry = CollectorRegistry()
        tracing.register_metrics(self.registry, prefix)

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        """``name`` without ``_total``: exposition appends it."""
        return Counter(self._checked(name, labels), doc, labels, registry=self.registry)

    def gauge(
        self, name: str, doc: str, labels: Sequence[str] = (), exported: bool = True
    ) -> Gauge:
        """``exported=False``: a gauge the code may set that this process does not serve
        (what it measures is not there, e.g. a Redis store not configured)."""
        registry = self.registry if exported else None
        return Gauge(self._checked(name, labels), doc, labels, registry=registry)

    def histogram(
        self, name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> Histogram:
        checked = self._checked(name, labels)
        return Histogram(checked, doc, labels, buckets=buckets, registry=self.registry)

    def render(self) -> bytes:
        """The page in Prometheus' classic text format."""
        return generate_latest(self.registry)

    def exposition(self, accept: str) -> tuple[bytes, str]:
        """The page in the format the scraper's ``Accept`` asks for, and its content type:
        OpenMetrics (which carries histograms' trace-id exemplars) where asked for, else
        the classic text format."""
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type

    def _checked(self, name: str, labels: Sequence[str]) -> str:
        if not name.startswith(self.prefix + "_"):
            raise ValueError(f"metric {name!r}: this component's start with {self.prefix}_")
        if name.endswith("_total"):
            raise ValueError(f"metric {name!r}: no _total (exposition appends it to counters)")
        if reserved := RESERVED_LABELS.intersection(labels):
            raise ValueError(f"metric {name!r}: label {sorted(reserved)} is Prometheus' own")
        return name
