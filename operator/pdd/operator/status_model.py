"""The PDDDeployment's status as the operator writes it: the CRD's status schema.

The operator builds its status as plain dicts (readiness.py, sizing.py, conditions.py,
reconcile.py) and patches them in; these models say what those dicts may hold, so that the
CRD (``pdd operator crd``) describes them and the API server keeps them (a structural schema
prunes a status field it does not know). tests/operator/test_crd.py checks that what the
operator computes fits them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from pdd.operator.conditions import CONDITION_TYPES

_TYPES = ", ".join(CONDITION_TYPES)


class _Status(BaseModel):
    """Base of every status part: camelCase, field docstrings as descriptions."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
    )


class Condition(_Status):
    """One condition."""

    type: str = Field(description=f"One of {_TYPES}.")
    status: Literal["True", "False", "Unknown"]
    """True, False or Unknown."""
    reason: str | None = None
    """Machine-readable reason (CamelCase)."""
    message: str | None = None
    """What is wrong and what to change."""
    observed_generation: int | None = None
    """metadata.generation the condition was computed for."""
    last_transition_time: str | None = Field(
        default=None, json_schema_extra={"format": "date-time"}
    )
    """When status last changed."""


class RoleStatus(_Status):
    desired: int | None = None
    """Replicas wanted (for the relay: what the HPA chose)."""
    ready: int | None = None
    """Replicas ready."""
    summary: str | None = None
    """ready/desired, for kubectl get."""


class Roles(_Status):
    prefill: RoleStatus | None = None
    """Prefill (P)."""
    relay: RoleStatus | None = None
    """Relay-decode (RLD)."""
    main: RoleStatus | None = None
    """Main-decode (MD)."""
    router: RoleStatus | None = None
    """Router."""


class KvCapacity(_Status):
    """One role's KV cache per pod."""

    kv_cache_gib: float | None = Field(default=None, alias="kvCacheGiB")
    """The configured size in GiB."""
    kv_cache_memory_fraction: float | None = None
    """The configured share of device memory (each pod reports what it got on /health)."""
    kv_capacity_tokens: int | None = None
    """kvCacheGiB in tokens, at the model's KV bytes per token."""


class EngineStatus(_Status):
    prefill: KvCapacity | None = None
    """The prefill's KV cache per pod."""
    relay: KvCapacity | None = None
    """The relay's KV cache per pod."""
    main: KvCapacity | None = None
    """Main decode's KV cache per pod."""


class RelayReplicas(_Status):
    min: int | None = None
    """For the mean load."""
    max: int | None = None
    """For the burst."""


class WanStatus(_Status):
    declared_gbps: float | None = None
    """spec.wan.declaredGbps."""
    rtt_ms: float | None = None
    """spec.wan.rttMs."""
    kv_bytes_per_token: int | None = None
    """KV bytes per token used for sizing."""
    kv_shape_reported_by: str | None = None
    """Without spec.model.config, the prefill pod whose reported KV shape (its /health) sized
    the link."""
    required_gbps: float | None = None
    """Mean cache-miss KV bit rate times the burst factor."""
    headroom: float | None = None
    """declaredGbps / requiredGbps (absent when nothing must cross)."""
    expected_relay_share: float | None = None
    """Share of requests whose miss transfer exceeds the TTFT budget (relayed through RLD)."""
    recommended_relay_replicas: RelayReplicas | None = None
    """Relay replicas for the mean load (min) and the burst (max)."""


class PDDStatus(_Status):
    """Observed state, written by the operator."""

    observed_generation: int | None = None
    """The metadata.generation the operator last reconciled."""
    conditions: list[Condition] | None = Field(
        default=None,
        description=f"{_TYPES}.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    roles: Roles | None = None
    """Replicas per role, read from the child Deployments in both clusters."""
    engine: EngineStatus | None = None
    """Each worker role's KV cache as configured (spec.engine with the role's override)."""
    wan: WanStatus | None = None
    """WAN link sizing from the shared cost model."""
