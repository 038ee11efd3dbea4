"""The planner's actuation: one HPA per worker role on the planner's External metric when
``spec.planner.enabled``; otherwise today's relay HPA and fixed P and MD replicas."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest

from pdd.operator.naming import Owner
from pdd.operator.plan import Cluster, build_plan, possible_children, ref_of
from pdd.operator.spec import PDDSpec
from pdd.operator.validation import InvalidSpecError, parse_spec

pytestmark = pytest.mark.unit

PLANNER = {
    "enabled": True,
    "prefill": {"costPerHour": 2.0, "minReplicas": 2, "maxReplicas": 40},
    "relay": {"minReplicas": 1, "maxReplicas": 8},
    "mainDecode": {"costPerHour": 2.5, "maxReplicas": 32},
}
SLO = {"ttftP90Seconds": 10, "itlP90Seconds": 0.08}


def with_planner(cr: dict[str, Any]) -> PDDSpec:
    spec = copy.deepcopy(cr["spec"])
    spec["planner"], spec["slo"] = PLANNER, SLO
    return parse_spec(spec, cr["metadata"]["name"])


def hpas(spec: PDDSpec, owner: Owner) -> dict[tuple[Cluster, str], dict[str, Any]]:
    plan = build_plan(spec, owner, "token")
    return {
        (cluster, obj["metadata"]["name"]): obj
        for cluster, obj in plan.children
        if obj["kind"] == "HorizontalPodAutoscaler"
    }


def replicas(spec: PDDSpec, owner: Owner) -> dict[str, Any]:
    plan = build_plan(spec, owner, "token")
    return {
        obj["metadata"]["name"]: obj["spec"].get("replicas")
        for _, obj in plan.children
        if obj["kind"] == "Deployment"
        and obj["metadata"]["name"] in {"qwen-prefill", "qwen-relay", "qwen-main"}
    }


def test_planner_off_leaves_the_relay_hpa_and_fixed_replicas(
    pool_b_spec: PDDSpec, owner: Owner
) -> None:
    found = hpas(pool_b_spec, owner)
    assert list(found) == [(Cluster.LOCAL, "qwen-relay")]
    assert found[(Cluster.LOCAL, "qwen-relay")]["spec"]["metrics"][0]["type"] == "Pods"
    got = replicas(pool_b_spec, owner)
    assert got["qwen-relay"] is None and got["qwen-prefill"] is not None
    assert got["qwen-main"] is not None


def test_planner_on_renders_one_external_metric_hpa_per_role(
    pool_b_cr: dict[str, Any], owner: Owner
) -> None:
    spec = with_planner(pool_b_cr)
    found = hpas(spec, owner)
    assert set(found) == {(Cluster.LOCAL, f"qwen-{r}") for r in ("prefill", "relay", "main")}
    bounds = {"prefill": (2, 40), "relay": (1, 8), "main": (1, 32)}
    for (_, name), hpa in found.items():
        role = name.removeprefix("qwen-")
        assert hpa["spec"]["scaleTargetRef"]["name"] == name
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == bounds[role]
        assert hpa["spec"]["metrics"] == [
            {
                "type": "External",
                "external": {
                    "metric": {
                        "name": "pdd_planner_desired_replicas",
                        "selector": {"matchLabels": {"pdddeployment": "qwen", "role": role}},
                    },
                    "target": {"type": "AverageValue", "averageValue": "1"},
                },
            }
        ]
        assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
        kubernetes_validate.validate(hpa, kubernetes_validate.latest_version(), strict=True)
    assert set(replicas(spec, owner).values()) == {None}  # every count is the HPAs'


def test_with_md_in_cluster_b_its_hpa_goes_there_and_is_cleaned_up_there(
    remote_cr: dict[str, Any], owner: Owner
) -> None:
    """Deletion walks possible_children in each cluster: cluster B's MD HPA among them."""
    spec = with_planner(remote_cr)
    found = hpas(spec, owner)
    assert (Cluster.REMOTE, "qwen-main") in found
    assert (Cluster.LOCAL, "qwen-main") not in found
    for cluster, obj in build_plan(spec, owner, "token").children:
        namespace = obj["metadata"]["namespace"]
        assert ref_of(cluster, obj) in possible_children(owner, cluster, namespace)


def test_the_planner_needs_its_targets(pool_b_cr: dict[str, Any]) -> None:
    spec = copy.deepcopy(pool_b_cr["spec"])
    spec["planner"] = {"enabled": True}
    with pytest.raises(InvalidSpecError, match=r"needs slo\.ttftP90Seconds"):
        parse_spec(spec, "qwen")
