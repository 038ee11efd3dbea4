"""Condition ModelAvailable: whether the pods' model-pull init containers got the model.

A ``huggingFace`` source is pulled by each pod's init container; a refused token, a
missing repo or revision make it exit with ``REASON: message`` in its termination
log (``pdd models pull --termination-log``). Kubernetes would only show the pod as
``Init:CrashLoopBackOff``; this reads the reason back from the pods' status so that
``kubectl get pdd`` / ``describe`` say what is wrong and what to change.
"""

from __future__ import annotations

import re
from typing import Any

from pdd.operator.builders.model_pull import MODEL_PULL_CONTAINER
from pdd.operator.conditions import Condition
from pdd.operator.spec import PDDSpec

MODEL_AVAILABLE = "ModelAvailable"
_REASON = re.compile(r"^([A-Z][A-Za-z0-9]*): (.*)$", re.DOTALL)


def model_condition(spec: PDDSpec, pods: list[dict[str, Any]]) -> Condition | None:
    """ModelAvailable for a pulled source (None for sources nothing pulls)."""
    source = spec.model.source.hugging_face
    if source is None:
        return None
    what = f"{source.repo}@{source.revision}"
    failures: list[tuple[str, str, str]] = []
    pulled = 0
    for pod in pods:
        status = _pull_status(pod)
        if status is None:
            continue
        state, last = status.get("state") or {}, status.get("lastState") or {}
        done = state.get("terminated")
        if done is not None and done.get("exitCode") == 0:
            pulled += 1
            continue
        failed = done if done is not None else last.get("terminated")
        if failed is not None and failed.get("exitCode", 0) != 0:
            reason, message = _reason(str(failed.get("message") or ""))
            failures.append((pod["metadata"]["name"], reason, message))
    if failures:
        name, reason, message = sorted(failures)[0]
        others = f" (and {len(failures) - 1} more pods)" if len(failures) > 1 else ""
        return Condition(MODEL_AVAILABLE, "False", reason,
                         f"pulling {what} failed in {name}{others}: {message}")  # fmt: skip
    if pods and pulled == len(pods):
        return Condition(MODEL_AVAILABLE, "True", "Pulled", f"{what} pulled by every pod")
    return Condition(
        MODEL_AVAILABLE, "Unknown", "Pulling",
        f"{what}: {pulled} of {len(pods)} pods pulled (progress: the {MODEL_PULL_CONTAINER} "
        "init container's log)",
    )  # fmt: skip


def _pull_status(pod: dict[str, Any]) -> dict[str, Any] | None:
    statuses = (pod.get("status") or {}).get("initContainerStatuses") or []
    return next((s for s in statuses if s.get("name") == MODEL_PULL_CONTAINER), None)


def _reason(termination_message: str) -> tuple[str, str]:
    """``REASON: message`` as the pull writes it; anything else (a crash's log tail,
    FallbackToLogsOnError) is PullFailed with its last line."""
    match = _REASON.match(termination_message.strip())
    if match:
        return match.group(1), " ".join(match.group(2).split())
    lines = [line for line in termination_message.splitlines() if line.strip()]
    return "PullFailed", lines[-1].strip() if lines else "the init container failed"
