"""Names shared by the operator's rendered config document and the pods that read it.

The operator writes one JSON document per cluster; workers and the router read it.
Both readers translate the same CRD spellings and check the same version, so those
live here, torch-free, rather than as copies that can drift apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Bumped when the config document changes shape, so readers refuse what they do not
#: understand instead of misreading it.
CONFIG_VERSION = 1
#: The environment variable that carries the shared secret into every pod.
SHARED_SECRET_ENV = "PDD_SHARED_SECRET"
#: The CRD's handoff policy names (camelCase) -> the worker's and router's ``--handoff`` values.
HANDOFF_POLICIES = {"auto": "auto", "oneShot": "one-shot", "catchUp": "catch-up"}


def version_mismatch(doc: Mapping[str, Any], component: str) -> str | None:
    """The error message when ``doc`` is not a version this reader knows, else None."""
    version = doc.get("version")
    if version == CONFIG_VERSION:
        return None
    return (
        f"config version {version!r} is not {CONFIG_VERSION}; "
        f"upgrade the {component} image to match the operator"
    )


def handoff_policy(doc: Mapping[str, Any]) -> str | None:
    """The document's handoff policy as a ``--handoff`` value; None when it sets none."""
    return HANDOFF_POLICIES.get(doc.get("handoff", {}).get("policy"))
