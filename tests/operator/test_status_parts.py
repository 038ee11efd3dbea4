"""Conditions, readiness and the status diff: the pure parts of status writing."""

from __future__ import annotations

import pytest

from pdd.operator.conditions import Condition, merge_conditions
from pdd.operator.model_status import model_condition
from pdd.operator.readiness import readiness_conditions, role_status
from pdd.operator.spec import PDDSpec
from pdd.operator.status import next_status

pytestmark = pytest.mark.unit


def test_transition_time_moves_only_when_status_flips() -> None:
    first = merge_conditions([], [Condition("Ready", "False", "A", "m")], "t1", 1)
    same = merge_conditions(first, [Condition("Ready", "False", "B", "m2")], "t2", 2)
    flipped = merge_conditions(same, [Condition("Ready", "True", "C", "m3")], "t3", 2)
    assert first[0]["lastTransitionTime"] == "t1"
    assert same[0]["lastTransitionTime"] == "t1" and same[0]["reason"] == "B"
    assert flipped[0]["lastTransitionTime"] == "t3"


def test_conditions_keep_a_fixed_order() -> None:
    merged = merge_conditions(
        [], [Condition(t, "True", "R", "") for t in ("LinkSized", "Degraded", "Ready")], "t", 1
    )
    assert [c["type"] for c in merged] == ["Ready", "Degraded", "LinkSized"]


def test_next_status_is_empty_when_nothing_changed() -> None:
    conditions = [Condition("Ready", "True", "AllReplicasReady", "ok")]
    first = next_status({}, {"observedGeneration": 1}, conditions, 1, "t1")
    assert next_status(first, {"observedGeneration": 1}, conditions, 1, "t2") == {}
    assert next_status(first, {"observedGeneration": 2}, conditions, 2, "t2").keys() == {
        "observedGeneration",
        "conditions",
    }


def test_role_status_prefers_the_deployments_replicas() -> None:
    hpa_scaled = {"spec": {"replicas": 3}, "status": {"readyReplicas": 2, "updatedReplicas": 3}}
    assert role_status(1, hpa_scaled) == {
        "desired": 3,
        "ready": 2,
        "summary": "2/3",
        "exists": True,
        "updated": True,
    }
    assert role_status(2, None)["summary"] == "0/2"


def test_readiness_conditions() -> None:
    ready = {"desired": 1, "ready": 1, "summary": "1/1", "exists": True, "updated": True}
    short = {"desired": 2, "ready": 1, "summary": "1/2", "exists": True, "updated": True}
    missing = role_status(1, None)
    conditions = readiness_conditions({"prefill": ready, "relay": ready})
    assert [(c.type, c.status) for c in conditions] == [("Ready", "True"), ("Progressing", "False")]
    conditions = readiness_conditions({"prefill": ready, "main": short})
    assert conditions[0].reason == "ReplicasNotReady" and "main 1/2" in conditions[0].message
    assert conditions[1].status == "True"
    assert readiness_conditions({"main": missing})[0].reason == "ChildMissing"


def _hf_spec() -> PDDSpec:
    return PDDSpec.model_validate({
        "model": {"servedName": "m", "source": {"huggingFace": {"repo": "acme/llm"}}},
        "images": {"worker": "w", "router": "r"},
        "poolB": {},
        "wan": {"declaredGbps": 10},
    })  # fmt: skip


def _pod(name: str, **status: object) -> dict:
    return {"metadata": {"name": name},
            "status": {"initContainerStatuses": [{"name": "model-pull", **status}]}}  # fmt: skip


def test_model_available_reads_the_pull_init_containers() -> None:
    spec = _hf_spec()
    done = _pod("a", state={"terminated": {"exitCode": 0}})
    running = _pod("b", state={"running": {}})
    refused = _pod("c", state={"waiting": {}}, lastState={"terminated": {
        "exitCode": 1, "message": "RepoNotFound: repository acme/llm not found\n"}})  # fmt: skip
    crashed = _pod("d", state={"terminated": {"exitCode": 137, "message": "log\nKilled"}})
    assert model_condition(spec, [done, done]) == Condition(
        "ModelAvailable", "True", "Pulled", "acme/llm@main pulled by every pod"
    )
    pending = model_condition(spec, [done, running])
    assert pending is not None and (pending.status, pending.reason) == ("Unknown", "Pulling")
    failed = model_condition(spec, [done, refused, running])
    assert failed is not None and (failed.status, failed.reason) == ("False", "RepoNotFound")
    assert failed.message.endswith("in c: repository acme/llm not found")
    crash = model_condition(spec, [crashed])
    assert crash is not None and (crash.reason, crash.message[-6:]) == ("PullFailed", "Killed")
