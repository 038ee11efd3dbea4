"""Status conditions in the Kubernetes shape (type, status, reason, message, times)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

#: The condition types a PDDDeployment reports, in the order they are listed.
CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "LinkSized", "ModelAvailable", "LineBound")


@dataclass(frozen=True)
class Condition:
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str  # CamelCase, machine-readable
    message: str  # what is wrong and what to change


def merge_conditions(
    existing: list[dict[str, Any]], updates: Iterable[Condition], now: str, generation: int
) -> list[dict[str, Any]]:
    """Existing conditions with ``updates`` applied.

    lastTransitionTime moves only when a condition's status flips, so rewriting the same
    verdict changes nothing and status writes stay idempotent.
    """
    by_type = {c["type"]: c for c in existing if "type" in c}
    for update in updates:
        old = by_type.get(update.type)
        changed = old is None or old.get("status") != update.status
        by_type[update.type] = {
            "type": update.type,
            "status": update.status,
            "reason": update.reason,
            "message": update.message,
            "observedGeneration": generation,
            "lastTransitionTime": now if old is None or changed else old["lastTransitionTime"],
        }
    order = {name: index for index, name in enumerate(CONDITION_TYPES)}
    return sorted(by_type.values(), key=lambda c: order.get(c["type"], len(order)))


def find(conditions: list[dict[str, Any]], type_: str) -> dict[str, Any] | None:
    return next((c for c in conditions if c.get("type") == type_), None)
