"""Shared harness for the chart tests: render the chart with real Helm (helm-python-sdk: no
binary, no cluster) and hand back the Kubernetes objects it produced.

Tests get it as the `chart` fixture; tests that take a `chart_values` argument run once per
values case (defaults, every optional part on, each examples/values-*.yaml).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]

# helm-python logs every symlinked chart file at INFO; the CRD link is deliberate.
helm_python.disable_logging()

#: Values that switch every optional part of the chart on, so that no template goes unchecked.
ALL_ON: dict[str, Any] = {
    "redis": {"enabled": True},
    "grafana": {"dashboard": {"enabled": True}},
    "metricsAdapter": {"rules": {"enabled": True}, "namespace": "monitoring"},
    "operator": {"watchNamespaces": ["team-a", "team-b"], "verbose": True},
    "imagePullSecrets": [{"name": "ghcr"}],
    "networkPolicy": {"enabled": True, "wanPeers": ["10.20.0.0/16"], "metricsFrom": ["monitoring"]},
}


@dataclass(frozen=True)
class ChartHarness:
    """The chart under test and the repository files it must agree with."""

    repo: Path = REPO
    release: str = "pdd"
    namespace: str = "pdd-system"

    @property
    def path(self) -> Path:
        return self.repo / "charts" / "pdd"

    #: The CRDs the chart installs, each a link to the repository's file: PDD's own, and
    #: kopf's peering kind the operator replicas meet in.
    crd_files: tuple[str, ...] = ("clusterkopfpeerings.yaml", "pdddeployments.yaml")

    def crd_source(self, name: str) -> Path:
        return self.repo / "crds" / name

    @property
    def examples(self) -> Path:
        return self.repo / "examples"

    def render(self, values: dict[str, Any] | None = None) -> dict[str, str]:
        """Template path (without the chart name) -> rendered text, comments kept."""
        with helm_python.Chart.load(self.path) as chart:
            prefix = f"{chart.name}/"
            manifests = chart.render(
                values, name=self.release, namespace=self.namespace, is_install=True
            )
        return {path.removeprefix(prefix): text for path, text in manifests.items()}

    def objects(self, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Every object the templates render (NOTES.txt excluded), in template order."""
        return [
            obj
            for path, text in sorted(self.render(values).items())
            if path.endswith(".yaml")
            for obj in yaml.safe_load_all(text)
            if obj
        ]

    def crds(self) -> list[dict[str, Any]]:
        """The CRDs the chart installs, as Helm loads them from the chart's crds/."""
        with helm_python.Chart.load(self.path) as chart:
            return [d for crd in chart.crds for d in yaml.safe_load_all(crd["data"]) if d]


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The one object of this kind and name; a clear error listing what there is otherwise."""
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    if len(matches) != 1:
        found = sorted(f"{o['kind']}/{o['metadata']['name']}" for o in objects)
        raise LookupError(f"expected one {kind}/{name}, found {len(matches)} among {found}")
    return matches[0]


def load_values(path: Path) -> dict[str, Any]:
    """A values file as `helm -f` reads it."""
    return helm_python.values_from_yaml(path.read_text())


@pytest.fixture
def chart() -> ChartHarness:
    return ChartHarness()


@pytest.fixture
def find_object():
    return find


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "chart_values" not in metafunc.fixturenames:
        return
    cases = [pytest.param(None, id="defaults"), pytest.param(ALL_ON, id="all-optional-parts")]
    for path in sorted((REPO / "examples").glob("values-*.yaml")):
        cases.append(pytest.param(load_values(path), id=path.name))
    metafunc.parametrize("chart_values", cases)
