"""What ``pdd.route``'s span says of a decision: the pipeline and why, the hits it
counted on, the KV it puts on the line and the link estimate it used."""

from __future__ import annotations

from pdd.common.cost_model import LinkState
from pdd.router.route import Route


def route_attributes(route: Route) -> dict[str, str | int | bool]:
    """The route's decision, as span attributes (``pdd.*``)."""
    out: dict[str, str | int | bool] = {
        "pdd.pipeline": str(route.pipeline),
        "pdd.reason_code": route.reason_code,
        "pdd.reason": route.reason,
        "pdd.prompt_tokens": route.prefill_tokens + route.p_hit_tokens,
        "pdd.p_hit_tokens": route.p_hit_tokens,
        "pdd.md_hit_tokens": route.md_hit_tokens,
        "pdd.kv_bytes": route.kv_bytes,
        "pdd.md_computes_miss": route.md_computes_miss,
        "pdd.wan.backlog_bytes": route.backlog.bytes,
        "pdd.wan.backlog_transfers": route.backlog.transfers,
    }
    for stage, endpoint in (
        ("prefill", route.prefill),
        ("relay", route.relay),
        ("main", route.main),
    ):
        if endpoint is not None:
            out[f"pdd.{stage}"] = endpoint.instance_id
    if route.kv_codec is not None:
        out["pdd.kv_codec"] = str(route.kv_codec)
    return out


def link_attributes(link: LinkState) -> dict[str, float | int]:
    """The WAN line as the policy saw it for this decision."""
    out: dict[str, float | int] = {
        "pdd.link.declared_gbps": link.declared_gbps,
        "pdd.link.effective_gbps": link.effective_gbps,
        "pdd.link.rtt_ms": link.rtt_ms,
    }
    if link.measured_goodput_gbps is not None:
        out["pdd.link.measured_gbps"] = link.measured_goodput_gbps
    return out
