"""Readiness per role, read from the child Deployments, and the conditions it implies."""

from __future__ import annotations

from typing import Any

from pdd.operator.conditions import Condition


def role_status(desired: int, deployment: dict[str, Any] | None) -> dict[str, Any]:
    """Desired and ready replicas of one role; the Deployment's own replicas win because
    the HPA, not the spec, decides how many relays there are."""
    if deployment is None:
        return {"desired": desired, "ready": 0, "summary": f"0/{desired}", "exists": False}
    desired = deployment.get("spec", {}).get("replicas", desired)
    status = deployment.get("status", {})
    ready = status.get("readyReplicas", 0)
    generation = deployment.get("metadata", {}).get("generation")
    observed = status.get("observedGeneration", generation)
    updated = status.get("updatedReplicas", desired) >= desired and observed == generation
    return {
        "desired": desired,
        "ready": ready,
        "summary": f"{ready}/{desired}",
        "exists": True,
        "updated": updated,
    }


def readiness_conditions(roles: dict[str, dict[str, Any]]) -> list[Condition]:
    """Ready and Progressing from the per-role replica counts."""
    missing = sorted(role for role, r in roles.items() if not r["exists"])
    short = sorted(role for role, r in roles.items() if r["exists"] and r["ready"] < r["desired"])
    rolling = sorted(role for role, r in roles.items() if r["exists"] and not r["updated"])
    if missing:
        ready = Condition("Ready", "False", "ChildMissing", f"no Deployment yet for {missing}")
    elif short:
        detail = ", ".join(f"{role} {roles[role]['summary']}" for role in short)
        ready = Condition("Ready", "False", "ReplicasNotReady", f"waiting for replicas: {detail}")
    else:
        ready = Condition("Ready", "True", "AllReplicasReady", "every role has its replicas ready")
    if missing or short or rolling:
        pending = sorted(set(missing) | set(short) | set(rolling))
        progressing = Condition("Progressing", "True", "RollingOut", f"rolling out {pending}")
    else:
        progressing = Condition("Progressing", "False", "Reconciled", "every role is up to date")
    return [ready, progressing]


def public_roles(roles: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The per-role view written to status.roles (desired, ready, summary)."""
    return {
        role: {"desired": r["desired"], "ready": r["ready"], "summary": r["summary"]}
        for role, r in roles.items()
    }
