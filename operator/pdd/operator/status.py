"""Writing a PDDDeployment's status: read, merge, write only what changed."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable
from typing import Any

from pdd.operator.conditions import Condition, merge_conditions
from pdd.operator.kube import KubeApi, ObjectPath
from pdd.operator.naming import KIND

StatusFields = dict[str, Any]


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def next_status(
    current: StatusFields,
    fields: StatusFields,
    conditions: Iterable[Condition],
    generation: int,
    now: str,
) -> StatusFields:
    """The status fields to write: ``fields`` plus the merged conditions, or only what
    differs from ``current`` (empty when nothing changed)."""
    merged = merge_conditions(current.get("conditions", []), conditions, now, generation)
    desired = {**fields, "conditions": merged}
    return {key: value for key, value in desired.items() if current.get(key) != value}


async def write_status(
    api: KubeApi,
    namespace: str,
    name: str,
    compute: Callable[[StatusFields, int], tuple[StatusFields, list[Condition]]],
) -> StatusFields:
    """Read the live object, compute (fields, conditions) from its status and generation,
    and patch the status subresource if anything differs. Returns what was written."""
    path = ObjectPath(KIND, namespace, name)
    live = await api.get(path)
    if live is None:  # deleted meanwhile: nothing to report on
        return {}
    current = live.get("status") or {}
    generation = live["metadata"].get("generation", 1)
    fields, conditions = compute(current, generation)
    changes = next_status(current, fields, conditions, generation, now_iso())
    if changes:
        await api.patch_status(path, changes)
    return changes
