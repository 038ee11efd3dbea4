"""Metadata shared by every child: where it lives, its labels, its owner, its hash."""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from pdd.operator.naming import SPEC_HASH_ANNOTATION, Component, Owner


@dataclass(frozen=True)
class Site:
    """Where a child lives: a namespace of cluster A, or of the remote cluster B.

    Cluster B objects cannot carry an owner reference to a cluster A object (owner
    UIDs are per cluster), so they are tied to their PDDDeployment by labels instead
    and removed by the operator's finalizer.
    """

    namespace: str
    remote: bool = False


def metadata(owner: Owner, role: Component | str, name: str, site: Site) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": site.namespace, "labels": owner.labels(role)}
    if not site.remote:
        meta["ownerReferences"] = [owner.owner_reference()]
    return meta


def content_hash(value: Any) -> str:
    """sha256 of a JSON value in canonical form (sorted keys, no whitespace)."""
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def with_spec_hash(obj: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``obj`` annotated with the hash of its own desired state.

    The operator compares this annotation with the live object's and writes only on a
    difference, so reconciling twice writes nothing (and nobody else's defaults, such
    as a Service's clusterIP, ever look like drift).
    """
    annotated = copy.deepcopy(obj)
    annotations = annotated["metadata"].setdefault("annotations", {})
    annotations.pop(SPEC_HASH_ANNOTATION, None)
    annotations[SPEC_HASH_ANNOTATION] = content_hash(annotated)
    return annotated
