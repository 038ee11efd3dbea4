"""A worker's spans name its role, instance and datacenter (issue 58), from the one mapping
of roles to datacenters the operator's pods use too (``pdd.common.vocabulary.datacenter``,
issue 57): a trace from ``pdd up`` and one from Kubernetes group the same way."""

from __future__ import annotations

from typing import Any

import pytest

from pdd.operator.naming import Component
from pdd.worker import server

pytestmark = pytest.mark.unit

#: The datacenters of the technique: P, RLD (and the mono baseline) beside the router in A.
EXPECTED = {"prefill": "A", "relay": "A", "main": "B", "mono": "A"}


@pytest.mark.parametrize("role", sorted(EXPECTED))
def test_a_workers_resource_names_its_datacenter(
    role: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(
        server, "config_from", lambda name, endpoint, file, attributes: seen.update(attributes)
    )
    monkeypatch.setattr(server, "configure", lambda config: None)
    server.configure_tracing(server.parse_args(["--role", role, "--instance-id", f"{role}-0"]))
    assert seen == {
        "pdd.role": role, "pdd.datacenter": EXPECTED[role], "service.instance.id": f"{role}-0"
    }  # fmt: skip


def test_the_one_mapping_covers_the_operators_components_and_the_router() -> None:
    from pdd.common.vocabulary import datacenter

    for role, dc in EXPECTED.items():
        assert datacenter(role) == dc
    assert datacenter(Component.ROUTER) == "A" and datacenter(Component.MAIN) == "B"
