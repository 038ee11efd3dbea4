"""WAN link sizing in status, via the shared cost model."""

from __future__ import annotations

import pytest

from pdd.common.config_document import EngineSettings
from pdd.common.cost_model import LinkState, WorkloadProfile, kv_bytes_per_token, size_wan_link
from pdd.operator.kv_size import resolve_kv_bytes_per_token
from pdd.operator.sizing import kv_capacity, size_link
from pdd.operator.spec import PDDSpec, Wan, Workload
from pdd.operator.worker_reports import ReportedShape, health_url, shape_from_health

pytestmark = pytest.mark.unit

KV_BPT = 2 * 36 * 8 * 128 * 2  # the pool-b example's model.config


def test_sufficient_link_reports_the_cost_models_numbers(pool_b_spec: PDDSpec) -> None:
    report = size_link(pool_b_spec)
    expected = size_wan_link(
        WorkloadProfile(10, 8000, 500, 0.9), KV_BPT, LinkState(25, 30), ttft_budget_s=5.0
    )
    assert report.wan["requiredGbps"] == round(expected.required_gbps, 3)
    assert report.wan["kvBytesPerToken"] == KV_BPT
    assert report.wan["declaredGbps"] == 25
    assert report.wan["recommendedRelayReplicas"] == {
        "min": expected.relay_replicas_min,
        "max": expected.relay_replicas_max,
    }
    assert report.condition.status == "True" and report.condition.reason == "LinkSufficient"
    assert not report.undersized
    # required = rate * input * miss * bytes * 8 * burst(2): 10 * 8000 * 0.1 * 147456 * 8 * 2
    assert report.wan["requiredGbps"] == round(10 * 8000 * 0.1 * KV_BPT * 8 * 2 / 1e9, 3)


def test_undersized_link_is_false_with_the_fix(pool_b_spec: PDDSpec) -> None:
    small = pool_b_spec.model_copy(update={"wan": Wan(declared_gbps=1, rtt_ms=30)})
    report = size_link(small)
    assert report.undersized
    assert (report.condition.status, report.condition.reason) == ("False", "LinkUndersized")
    assert "raise wan.declaredGbps" in report.condition.message
    assert report.wan["headroom"] < 1


def test_kv_size_unknown_says_which_fields_to_set(remote_spec: PDDSpec) -> None:
    model = remote_spec.model.model_copy(update={"kv_bytes_per_token": None, "config": None})
    report = size_link(remote_spec.model_copy(update={"model": model}))
    assert (report.condition.status, report.condition.reason) == ("Unknown", "KVSizeUnknown")
    assert "model.kvBytesPerToken" in report.condition.message
    assert "requiredGbps" not in report.wan


def test_workload_unknown(remote_spec: PDDSpec) -> None:
    report = size_link(remote_spec)
    assert (report.condition.status, report.condition.reason) == ("Unknown", "WorkloadUnknown")


def test_explicit_kv_bytes_win_over_model_config(pool_b_spec: PDDSpec) -> None:
    model = pool_b_spec.model.model_copy(update={"kv_bytes_per_token": 1000})
    assert resolve_kv_bytes_per_token(model) == 1000
    assert resolve_kv_bytes_per_token(pool_b_spec.model) == KV_BPT


def test_relay_max_below_recommendation_is_mentioned(pool_b_spec: PDDSpec) -> None:
    heavy = pool_b_spec.model_copy(
        update={
            "workload": Workload(
                request_rate=200, mean_input_tokens=64000, mean_output_tokens=1000,
                mean_md_hit_rate=0.5,
            ),
            "wan": Wan(declared_gbps=10, rtt_ms=30),
        }
    )  # fmt: skip
    report = size_link(heavy)
    assert report.wan["recommendedRelayReplicas"]["max"] > heavy.relay.max_replicas
    assert "relay.maxReplicas (3) is below" in report.condition.message


def test_status_reports_each_roles_kv_capacity_with_the_shared_kv_size(
    pool_b_spec: PDDSpec,
) -> None:
    spec = pool_b_spec.model_copy(
        update={
            "engine": EngineSettings(kv_cache_memory_fraction=0.85),
            "main_decode": pool_b_spec.main_decode.model_copy(
                update={"engine": EngineSettings(kv_cache_gib=48)}
            ),
        }
    )
    report = kv_capacity(spec)
    assert report["main"] == {
        "kvCacheGiB": 48,
        "kvCapacityTokens": 48 * 2**30 // resolve_kv_bytes_per_token(spec.model),
    }
    assert report["main"]["kvCapacityTokens"] == 48 * 2**30 // KV_BPT
    assert report["prefill"] == report["relay"] == {"kvCacheMemoryFraction": 0.85}
    assert kv_capacity(pool_b_spec) == {"prefill": {}, "relay": {}, "main": {}}


@pytest.mark.parametrize(("codec", "most"), [("int8", 0.52), ("fp8", 0.52), ("int4", 0.28)])
def test_a_compressed_deployment_needs_a_smaller_link(
    pool_b_spec: PDDSpec, codec: str, most: float
) -> None:
    """spec.wan.kvCodec: the link is sized for the coded bytes, through the one formula."""
    exact = size_link(pool_b_spec)
    wan = pool_b_spec.wan.model_copy(update={"kv_codec": codec})
    coded = size_link(pool_b_spec.model_copy(update={"wan": wan}))
    shape = pool_b_spec.model.config
    assert shape is not None
    wire = kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, 2, codec)  # type: ignore[arg-type]
    assert coded.wan["kvBytesPerToken"] == wire <= most * KV_BPT
    assert coded.wan["requiredGbps"] == round(10 * 8000 * 0.1 * wire * 8 * 2 / 1e9, 3)
    assert coded.wan["requiredGbps"] <= most * exact.wan["requiredGbps"]
    assert coded.condition.reason == "LinkSufficient"
    # The KV cache itself is not coded: each pod's capacity in tokens is unchanged.
    assert kv_capacity(pool_b_spec.model_copy(update={"wan": wan})) == kv_capacity(pool_b_spec)


def test_a_compressed_link_without_the_models_shape_says_what_to_set(
    pool_b_spec: PDDSpec,
) -> None:
    model = pool_b_spec.model.model_copy(update={"kv_bytes_per_token": 1000, "config": None})
    wan = pool_b_spec.wan.model_copy(update={"kv_codec": "int4"})
    report = size_link(pool_b_spec.model_copy(update={"model": model, "wan": wan}))
    assert (report.condition.status, report.condition.reason) == ("Unknown", "KVSizeUnknown")
    assert "wan.kvCodec int4" in report.condition.message
    assert "model.config" in report.condition.message


def test_an_adaptive_deployment_is_sized_for_the_exact_kv(pool_b_spec: PDDSpec) -> None:
    """spec.wan.kvCodec adaptive: a transfer may cross exact, so the link is sized for it,
    and the model's declared bytes per token are enough to size it."""
    wan = pool_b_spec.wan.model_copy(update={"kv_codec": "adaptive"})
    adaptive = size_link(pool_b_spec.model_copy(update={"wan": wan}))
    assert adaptive.wan == size_link(pool_b_spec).wan
    model = pool_b_spec.model.model_copy(update={"kv_bytes_per_token": 1000, "config": None})
    shapeless = size_link(pool_b_spec.model_copy(update={"model": model, "wan": wan}))
    assert shapeless.wan["kvBytesPerToken"] == 1000


# -- the KV shape a worker reports (spec without model.config) ------------------------


def health_body(kv_shape: dict | None) -> dict:
    """A worker's GET /health body (pdd.common.wire.WorkerHealth)."""
    engine = {"device": "cpu", "dtype": "bfloat16", "block_size": 16, "kv_blocks": 8,
              "kv_tokens": 128, "kv_bytes": 1, "max_running_requests": 4, "max_model_len": 64,
              "max_prompt_tokens": 63, "max_num_batched_tokens": 64}  # fmt: skip
    if kv_shape is not None:
        engine["kv_shape"] = kv_shape
    endpoint = {"instance_id": "p-0", "http_url": "http://10.0.0.7:8000",
                "fast_addr": "10.0.0.7:9000", "wan_addr": "10.0.0.7:9100"}  # fmt: skip
    return {"status": "ok", "role": "prefill", "endpoint": endpoint, "engine": engine}


QWEN3_8B = {"num_layers": 36, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16",
            "bytes_per_token": KV_BPT}  # fmt: skip


def without_shape(spec: PDDSpec) -> PDDSpec:
    model = spec.model.model_copy(update={"config": None, "kv_bytes_per_token": None})
    return spec.model_copy(update={"model": model})


def test_a_reported_shape_sizes_the_link_as_the_same_shape_in_the_spec(
    pool_b_spec: PDDSpec,
) -> None:
    found = shape_from_health(health_body(QWEN3_8B))
    assert found is not None
    reported = ReportedShape(found[0], found[1], "qwen-prefill-abc")
    bare = without_shape(pool_b_spec)
    assert size_link(bare).condition.reason == "KVSizeUnknown"
    from_pod, from_spec = size_link(bare, reported), size_link(pool_b_spec)
    assert from_pod.wan == {**from_spec.wan, "kvShapeReportedBy": "qwen-prefill-abc"}
    assert from_pod.condition == from_spec.condition
    assert kv_capacity(bare, reported) == kv_capacity(pool_b_spec)
    # the spec's own shape wins over a report (the user said what to size for)
    assert "kvShapeReportedBy" not in size_link(pool_b_spec, reported).wan


def test_a_compressed_link_is_sized_from_the_reported_shape(pool_b_spec: PDDSpec) -> None:
    found = shape_from_health(health_body(QWEN3_8B))
    assert found is not None
    wan = pool_b_spec.wan.model_copy(update={"kv_codec": "int8"})
    bare = without_shape(pool_b_spec).model_copy(update={"wan": wan})
    report = size_link(bare, ReportedShape(found[0], found[1], "p"))
    assert report.wan["kvBytesPerToken"] == kv_bytes_per_token(36, 8, 128, 2, "int8")
    assert report.wan["kvBytesPerToken"] < KV_BPT


def test_what_a_health_body_does_not_report() -> None:
    assert shape_from_health(health_body(None)) is None  # a worker older than kv_shape
    assert shape_from_health({"status": "misconfigured", "role": "prefill",
                              "instance_id": "p", "problem": "x"}) is None  # fmt: skip
    assert shape_from_health(health_body({**QWEN3_8B, "dtype": "float64"})) is None
    assert shape_from_health("not json") is None


def pod(name: str, phase: str = "Running", ready: str = "True", ip: str | None = "10.0.0.7",
        port: int | None = 8000) -> dict:  # fmt: skip
    ports = [{"name": "kv", "containerPort": 9000}]
    if port is not None:
        ports.append({"name": "http", "containerPort": port})
    status: dict = {"phase": phase, "conditions": [{"type": "Ready", "status": ready}]}
    if ip is not None:
        status["podIP"] = ip
    return {"metadata": {"name": name},
            "spec": {"containers": [{"name": "prefill", "ports": ports}]},
            "status": status}  # fmt: skip


def test_only_running_ready_pods_with_an_http_port_are_asked() -> None:
    assert health_url(pod("a")) == "http://10.0.0.7:8000/health"
    assert health_url(pod("a", ip="fd00::7")) == "http://[fd00::7]:8000/health"
    assert health_url(pod("a", phase="Pending")) is None
    assert health_url(pod("a", ready="False")) is None
    assert health_url(pod("a", ip=None)) is None
    assert health_url(pod("a", port=None)) is None
