"""WAN link sizing for status: the shared cost model's verdict, phrased for users."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pdd.common.cost_model import LinkState, WorkloadProfile, size_wan_link
from pdd.common.kv_codec import NO_CODEC
from pdd.operator.builders.config import engine_settings
from pdd.operator.conditions import Condition
from pdd.operator.kv_size import resolve_kv_bytes_per_token, resolve_wan_kv_bytes_per_token
from pdd.operator.spec import PDDSpec
from pdd.operator.worker_reports import ReportedShape, needs_reported_shape, with_reported_shape


@dataclass(frozen=True)
class LinkReport:
    wan: dict[str, Any]  # status.wan
    condition: Condition  # LinkSized
    undersized: bool  # worth a Warning event


def size_link(spec: PDDSpec, reported: ReportedShape | None = None) -> LinkReport:
    """Size the declared link for the expected workload, or say what is missing. The KV
    shape is the spec's ``model.config``, else the one a worker ``reported``."""
    wan: dict[str, Any] = {"declaredGbps": spec.wan.declared_gbps, "rttMs": spec.wan.rtt_ms}
    if reported is not None and needs_reported_shape(spec):
        spec = with_reported_shape(spec, reported)
        wan["kvShapeReportedBy"] = reported.pod
    kv_bpt = resolve_wan_kv_bytes_per_token(spec.model, spec.wan.kv_codec)
    if kv_bpt is None:
        return LinkReport(wan, _kv_size_unknown(spec), False)
    wan["kvBytesPerToken"] = kv_bpt
    if spec.workload is None:
        message = (
            "cannot size the WAN link: set workload (requestRate, meanInputTokens, "
            "meanOutputTokens, meanMDHitRate) to the traffic you expect"
        )
        return LinkReport(wan, Condition("LinkSized", "Unknown", "WorkloadUnknown", message), False)
    w = spec.workload
    sizing = size_wan_link(
        WorkloadProfile(w.request_rate, w.mean_input_tokens, w.mean_output_tokens,
                        w.mean_md_hit_rate),
        kv_bpt,
        LinkState(spec.wan.declared_gbps, spec.wan.rtt_ms),
        ttft_budget_s=spec.slo.ttft_p99_ms / 1000.0,
    )  # fmt: skip
    wan.update(
        requiredGbps=round(sizing.required_gbps, 3),
        expectedRelayShare=round(sizing.expected_relay_share, 4),
        recommendedRelayReplicas={
            "min": sizing.relay_replicas_min,
            "max": sizing.relay_replicas_max,
        },
    )
    if math.isfinite(sizing.headroom):
        wan["headroom"] = round(sizing.headroom, 3)
    relay_note = _relay_note(spec, sizing.relay_replicas_max)
    if not sizing.sufficient:
        message = (
            f"declared {spec.wan.declared_gbps:g} Gbps is below the required "
            f"{sizing.required_gbps:.3g} Gbps for this workload: raise wan.declaredGbps, "
            "or expect more requests to be relayed and queued" + relay_note
        )
        return LinkReport(wan, Condition("LinkSized", "False", "LinkUndersized", message), True)
    message = (
        f"declared {spec.wan.declared_gbps:g} Gbps covers the required "
        f"{sizing.required_gbps:.3g} Gbps" + relay_note
    )
    return LinkReport(wan, Condition("LinkSized", "True", "LinkSufficient", message), False)


def _kv_size_unknown(spec: PDDSpec) -> Condition:
    waiting = (
        "not sized until a ready prefill pod reports the KV shape it loaded, or set "
        "model.config (numLayers, numKVHeads, headDim, dtype; `pdd models inspect` prints it)"
    )
    if spec.wan.kv_codec == NO_CODEC:
        message = f"KV size unknown: {waiting}, or model.kvBytesPerToken"
    else:
        message = (
            f"KV size unknown: wan.kvCodec {spec.wan.kv_codec} sizes the compressed KV from "
            f"the model's shape; {waiting}"
        )
    return Condition("LinkSized", "Unknown", "KVSizeUnknown", message)


def _relay_note(spec: PDDSpec, recommended_max: int) -> str:
    if spec.relay.max_replicas >= recommended_max:
        return ""
    return (
        f"; relay.maxReplicas ({spec.relay.max_replicas}) is below the "
        f"{recommended_max} relays this workload may need at its burst"
    )


def kv_capacity(spec: PDDSpec, reported: ReportedShape | None = None) -> dict[str, dict[str, Any]]:
    """status.engine: each worker role's KV cache as configured, and in tokens per pod
    where a fixed size makes that computable here (a fraction of device memory is
    resolved by each pod at start and reported on its ``/health``)."""
    spec = with_reported_shape(spec, reported)
    kv_bpt = resolve_kv_bytes_per_token(spec.model)
    report: dict[str, dict[str, Any]] = {}
    for role, settings in engine_settings(spec).model_dump().items():
        entry: dict[str, Any] = {}
        gib, fraction = settings["kv_cache_gib"], settings["kv_cache_memory_fraction"]
        if gib is not None:
            entry["kvCacheGiB"] = gib
            if kv_bpt is not None:
                entry["kvCapacityTokens"] = int(gib * 2**30) // kv_bpt
        if fraction is not None:
            entry["kvCacheMemoryFraction"] = fraction
        report[role] = entry
    return report
