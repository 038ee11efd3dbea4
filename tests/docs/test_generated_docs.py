"""Generated sections of docs/ match the code: a block between ``<!-- generated: NAME -->`` and
``<!-- end generated -->`` is what ``GENERATORS[NAME]()`` returns. The tests fail when
a page differs from its code; ``PDD_UPDATE_DOCS=1`` rewrites the pages instead:

    PDD_UPDATE_DOCS=1 .venv/bin/python -m pytest tests/docs -n 0
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from pdd.common.config_document import EngineSettings, WanKVSettings
from pdd.common.settings import flag_table, settings_of, settings_table

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
BLOCK = re.compile(
    r"(<!-- generated: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S
)


def _router_settings() -> str:
    from pdd.router.config import router_settings

    return settings_table(router_settings(), "")


def _policy_rules() -> str:
    from pdd.router.policy_rules import rules_table

    return rules_table()


def _flags(module: str) -> Callable[[], str]:
    return lambda: flag_table(importlib.import_module(module).build_parser())


def metric_families(registry: CollectorRegistry) -> list[tuple[str, str, tuple[str, ...], str]]:
    """(name as exposed, type, labels, help) of every metric a registry exports, sorted;
    a counter's name with the ``_total`` that exposition appends, a histogram's base."""
    rows = []
    for collector in list(registry._collector_to_names):
        if isinstance(collector, MetricWrapperBase):
            found = [(collector._name, collector._type, collector._labelnames,
                      collector._documentation)]  # fmt: skip
        else:
            found = [(m.name, m.type, getattr(m, "_labelnames", ()), m.documentation)
                     for m in collector.collect()]  # fmt: skip
        for name, kind, labels, doc in found:
            rows.append((name + "_total" if kind == "counter" else name, kind, tuple(labels), doc))
    return sorted(rows)


def component_registries() -> dict[str, CollectorRegistry]:
    """Each component's registry with every metric it can export (the router's with a
    Redis store configured, so ``redis_up`` is among them)."""
    from pdd.operator.planner_publish import PlannerMetrics
    from pdd.router.metrics import RouterMetrics
    from pdd.worker.metrics import WorkerMetrics
    from pdd.worker.refused_config import refused_registry

    return {
        "router": RouterMetrics(redis=True).registry,
        "worker": WorkerMetrics("prefill").registry,
        "worker (engine settings refused)": refused_registry(),
        "planner (in the operator)": PlannerMetrics().registry,
    }


def metrics_table() -> str:
    parts = []
    for component, registry in component_registries().items():
        rows = ["| Metric | Type | Labels | Meaning |", "|---|---|---|---|"]
        for name, kind, labels, doc in metric_families(registry):
            shown = ", ".join(f"`{label}`" for label in labels)
            rows.append(f"| `{name}` | {kind} | {shown} | {doc} |")
        parts.append(f"### {component}\n\n" + "\n".join(rows) + "\n")
    return "\n".join(parts)


GENERATORS: dict[str, Callable[[], str]] = {
    "metrics": metrics_table,
    "engine-settings": lambda: settings_table(settings_of(EngineSettings), "engine."),
    "wan-kv-settings": lambda: settings_table(settings_of(WanKVSettings), "wan."),
    "router-settings": _router_settings,
    "policy-rules": _policy_rules,
    "flags-router": _flags("pdd.router.server"),
    "flags-worker": _flags("pdd.worker.server"),
    "flags-wan-link": _flags("pdd.wan.cli"),
    "flags-up": _flags("pdd.local.up"),
    "flags-operator": _flags("pdd.operator.main"),
}


def render(text: str) -> str:
    """``text`` with every generated block replaced by what its generator returns now."""

    def fill(m: re.Match[str]) -> str:
        return m.group(1) + GENERATORS[m.group("name")]() + m.group(4)

    return BLOCK.sub(fill, text)


def blocks(text: str) -> list[str]:
    return [m.group("name") for m in BLOCK.finditer(text)]


PAGES = sorted(p for p in (REPO / "docs").glob("*.md") if "<!-- generated:" in p.read_text())


def test_every_generator_has_its_block_in_a_page() -> None:
    used = {name for page in PAGES for name in blocks(page.read_text())}
    assert used == set(GENERATORS)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_page_matches_the_code(page) -> None:
    text = page.read_text()
    fresh = render(text)
    if os.environ.get("PDD_UPDATE_DOCS") == "1":
        page.write_text(fresh)
    assert fresh == text, f"{page.name} is stale: PDD_UPDATE_DOCS=1 pytest tests/docs -n 0"


#: One prefix per component.
PREFIXES = {"router": "pdd_router_", "worker": "pdd_worker_", "planner": "pdd_planner_"}


@pytest.mark.parametrize("component", sorted(component_registries()))
def test_metric_names_follow_prometheus_conventions(component: str) -> None:
    """Counters end in _total and nothing else does; base units (no gbps, tokens_per_s,
    milliseconds); one prefix per component; no label Prometheus sets itself."""
    prefix = PREFIXES[component.split()[0]]
    for name, kind, labels, _ in metric_families(component_registries()[component]):
        assert name.startswith(prefix), name
        assert name.endswith("_total") == (kind == "counter"), f"{name} is a {kind}"
        assert not re.search(r"gbps|_per_s$|_per_s_|_ms$|_ms_|_mb$|_percent", name), name
        assert not {"instance", "job"} & set(labels), f"{name} labels {labels}"


def test_redis_up_only_where_redis_is_configured() -> None:
    from pdd.router.metrics import RouterMetrics

    def names(metrics: RouterMetrics) -> set[str]:
        return {name for name, *_ in metric_families(metrics.registry)}

    assert "pdd_router_redis_up" not in names(RouterMetrics())
    assert "pdd_router_redis_up" in names(RouterMetrics(redis=True))
