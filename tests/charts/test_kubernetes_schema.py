"""Every object the chart renders (and every plain Kubernetes object in examples/) is valid for
the newest Kubernetes version kubernetes-validate ships, in strict mode (unknown fields fail)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
KUBERNETES = kubernetes_validate.latest_version()


def validate(obj: dict[str, Any]) -> None:
    """Raise with the object's kind/name and the failing path when it is not valid."""
    try:
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)
    except kubernetes_validate.ValidationError as err:
        where = ".".join(str(p) for p in err.path)
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        raise AssertionError(
            f"{name} invalid for Kubernetes {KUBERNETES} at {where}: {err.message}"
        ) from None


def test_every_rendered_object_is_valid(chart, chart_values: dict[str, Any] | None) -> None:
    """Built-in kinds against Kubernetes' schemas; kinds of the chart's own CRDs (the
    operators' peering object) against the schema their CRD declares."""
    objects = chart.objects(chart_values)
    assert objects
    own = {crd["spec"]["names"]["kind"]: crd for crd in chart.crds()}
    for obj in objects:
        if obj["kind"] in own:
            validate_custom(obj, own[obj["kind"]])
        else:
            validate(obj)


def validate_custom(obj: dict[str, Any], crd: dict[str, Any]) -> None:
    """A served version, the CRD's scope, and its schema for everything below metadata."""
    served = {f"{crd['spec']['group']}/{v['name']}": v for v in crd["spec"]["versions"]}
    assert obj["apiVersion"] in served, f"{obj['kind']}: {obj['apiVersion']} is not served"
    if crd["spec"]["scope"] == "Cluster":
        assert "namespace" not in obj["metadata"], f"{obj['kind']} is cluster-scoped"
    schema = served[obj["apiVersion"]]["schema"]["openAPIV3Schema"]
    body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
    jsonschema.Draft4Validator(schema).validate(body)


def test_the_crds_the_chart_installs_are_valid(chart) -> None:
    crds = chart.crds()
    assert len(crds) == len(chart.crd_files)
    for crd in crds:
        validate(crd)


@pytest.mark.parametrize(
    "obj",
    [
        pytest.param(doc, id=f"{path.name}:{doc['kind']}/{doc['metadata']['name']}")
        for path in sorted((REPO / "examples").glob("*.yaml"))
        if not path.name.startswith("values-")
        for doc in yaml.safe_load_all(path.read_text())
        if doc and doc["apiVersion"] != "pdd.dev/v1alpha1"
    ],
)
def test_plain_example_objects_are_valid(obj: dict[str, Any]) -> None:
    validate(obj)


def test_validation_would_catch_a_misspelt_field(chart, find_object) -> None:
    deployment = find_object(chart.objects(), "Deployment", "pdd-operator")
    deployment["spec"]["template"]["spec"]["serviceAcountName"] = "typo"
    with pytest.raises(AssertionError, match="serviceAcountName"):
        validate(deployment)
