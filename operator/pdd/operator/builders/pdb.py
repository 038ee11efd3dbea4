"""PodDisruptionBudgets: a node drain takes at most one pod of a role at a time."""

from __future__ import annotations

from typing import Any

from pdd.operator.builders.meta import Site, metadata
from pdd.operator.naming import Component, Owner


def build_pdb(owner: Owner, role: Component, site: Site) -> dict[str, Any]:
    """maxUnavailable 1 (not minAvailable) so a single-replica role can still be drained."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(owner, role, owner.child(role), site),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": owner.selector_labels(role)}},
    }
