"""The chart ships the repository's one CRD (not a copy), the examples are PDDDeployments that
CRD admits, and every object the examples make the operator write is one its RBAC allows."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import pytest
import yaml

from pdd.operator.builders.wan_tls import new_wan_tls
from pdd.operator.kube import RESOURCES
from pdd.operator.naming import Owner
from pdd.operator.plan import Cluster, build_plan
from pdd.operator.validation import parse_spec

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
#: Verbs the operator's API client uses on a child: get, POST (create), server-side apply and
#: status merge patches (patch), delete.
CHILD_VERBS = {"get", "create", "patch", "delete"}


def example_docs(kind: str) -> list[Any]:
    return [
        pytest.param(doc, id=f"{path.name}:{doc['metadata']['name']}")
        for path in sorted(EXAMPLES.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc and doc.get("kind") == kind
    ]


def openapi_as_json_schema(node: Any) -> Any:
    """The CRD's openAPIV3Schema without the x-kubernetes-* extensions JSON Schema lacks."""
    if isinstance(node, list):
        return [openapi_as_json_schema(item) for item in node]
    if isinstance(node, dict):
        return {
            k: openapi_as_json_schema(v)
            for k, v in node.items()
            if not k.startswith("x-kubernetes")
        }
    return node


@pytest.fixture(scope="module")
def cr_validator() -> jsonschema.Validator:
    crd = yaml.safe_load((REPO / "crds" / "pdddeployments.yaml").read_text())
    schema = openapi_as_json_schema(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    # OpenAPI 3.0 schemas are draft 4 at heart (boolean exclusiveMinimum).
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def test_chart_crds_are_relative_links_to_the_repository_crds(chart) -> None:
    for name in chart.crd_files:
        link = chart.path / "crds" / name
        assert link.is_symlink(), f"charts/pdd/crds/{name} must link, not copy"
        target = os.readlink(link)
        assert not os.path.isabs(target), "an absolute link breaks in every other checkout"
        assert link.resolve() == chart.crd_source(name).resolve()


def test_helm_loads_the_crds_byte_for_byte(chart) -> None:
    with helm_python.Chart.load(chart.path) as loaded:
        crds = loaded.crds
    assert [c["name"] for c in crds] == [f"crds/{name}" for name in chart.crd_files]
    for crd, name in zip(crds, chart.crd_files, strict=True):
        assert crd["data"].encode() == chart.crd_source(name).read_bytes()


def test_packaged_chart_carries_the_crds_themselves(chart, tmp_path: Path) -> None:
    """`helm package` must resolve the links: the .tgz a user installs has the real files."""
    archive = helm_python.package(chart.path, destination=tmp_path)
    helm_python.expand(tmp_path / "out", archive)
    for name in chart.crd_files:
        packaged = tmp_path / "out" / "pdd" / "crds" / name
        assert not packaged.is_symlink()
        assert packaged.read_bytes() == chart.crd_source(name).read_bytes()


@pytest.mark.parametrize("cr", example_docs("PDDDeployment"))
def test_example_is_admitted_by_the_crd_schema(cr: dict[str, Any], cr_validator) -> None:
    errors = [f"{e.json_path}: {e.message}" for e in cr_validator.iter_errors(cr)]
    assert errors == []


@pytest.mark.parametrize(
    ("path", "bad"),
    [(("spec", "wan", "declaredGbps"), "fast"), (("spec", "relay", "targetLoad"), 0)],
    ids=["string-bandwidth", "zero-target-load"],
)
def test_the_schema_check_refuses_a_broken_example(cr_validator, path, bad) -> None:
    [param, *_] = example_docs("PDDDeployment")
    cr = copy.deepcopy(param.values[0])
    node = cr
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad
    assert list(cr_validator.iter_errors(cr))


@pytest.mark.parametrize("cr", example_docs("PDDDeployment"))
def test_every_local_child_is_allowed_by_the_chart_cluster_role(
    cr: dict[str, Any], chart, find_object
) -> None:
    role = find_object(chart.objects(), "ClusterRole", "pdd-operator")
    granted = _grants(role["rules"])
    for kind in _child_kinds(cr, Cluster.LOCAL):
        group, plural = _group_and_plural(kind)
        missing = {verb for verb in CHILD_VERBS if (group, plural, verb) not in granted}
        assert not missing, f"the ClusterRole cannot {sorted(missing)} {plural} ({kind})"


def test_remote_children_are_allowed_by_the_cluster_b_role() -> None:
    [remote_cr] = [
        p.values[0] for p in example_docs("PDDDeployment") if "remoteCluster" in p.values[0]["spec"]
    ]
    docs = list(yaml.safe_load_all((EXAMPLES / "cluster-b-rbac.yaml").read_text()))
    [role] = [d for d in docs if d["kind"] == "Role"]
    assert role["metadata"]["namespace"] == remote_cr["spec"]["remoteCluster"]["namespace"]
    granted = _grants(role["rules"])
    planned = copy.deepcopy(remote_cr)  # with the planner, MD's HPA goes to cluster B too
    planned["spec"]["slo"] = {"ttftP90Seconds": 10, "itlP90Seconds": 0.08}
    planned["spec"]["planner"] = {"enabled": True}
    kinds = _child_kinds(remote_cr, Cluster.REMOTE) | _child_kinds(planned, Cluster.REMOTE)
    assert {"Deployment", "HorizontalPodAutoscaler"} <= kinds
    for kind in kinds:
        group, plural = _group_and_plural(kind)
        assert {(group, plural, v) for v in CHILD_VERBS} <= granted, kind
    # and nothing beyond what MD's objects need
    assert {(g, r) for g, r, _ in granted} == {_group_and_plural(k) for k in kinds}


def test_two_cluster_example_names_its_kubeconfig_secret() -> None:
    docs = list(yaml.safe_load_all((EXAMPLES / "two-clusters.yaml").read_text()))
    [secret] = [d for d in docs if d["kind"] == "Secret"]
    [cr] = [d for d in docs if d["kind"] == "PDDDeployment"]
    ref = cr["spec"]["remoteCluster"]["kubeconfigSecret"]
    assert (secret["metadata"]["name"], secret["metadata"]["namespace"]) == (
        ref["name"],
        cr["metadata"]["namespace"],
    )
    kubeconfig = yaml.safe_load(secret["stringData"][ref["key"]])
    assert kubeconfig["kind"] == "Config" and kubeconfig["current-context"]


def _child_kinds(cr: dict[str, Any], cluster: Cluster) -> set[str]:
    meta = cr["metadata"]
    spec = parse_spec(cr["spec"], meta["name"])
    owner = Owner(name=meta["name"], namespace=meta["namespace"], uid="0000-example")
    plan = build_plan(spec, owner, token="example-token", wan_tls=new_wan_tls(meta["name"]))
    return {obj["kind"] for where, obj in plan.children if where is cluster}


def _group_and_plural(kind: str) -> tuple[str, str]:
    api_version, plural = RESOURCES[kind]
    return (api_version.split("/")[0] if "/" in api_version else "", plural)


def _grants(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
