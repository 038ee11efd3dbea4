"""spec.observability.tracing reaches every pod as the standard OTEL_* variables (issue 58).

With tracing set, the router and each worker role (in cluster A and in cluster B) carry
the endpoint, the ratio sampler, their own service.name and resource attributes naming
their datacenter, pool and Kubernetes names; without it, no pod carries any OTEL_*
variable. A bad endpoint or ratio is refused before anything is rendered.
"""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest

from pdd.operator.naming import Owner
from pdd.operator.plan import build_plan
from pdd.operator.spec import PDDSpec
from pdd.operator.validation import InvalidSpecError, parse_spec

pytestmark = pytest.mark.unit

TOKEN = "s3cret-token"
ENDPOINT = "http://otel-collector.monitoring:4318"


def traced(cr: dict[str, Any], **tracing: Any) -> PDDSpec:
    spec = copy.deepcopy(cr["spec"])
    spec["observability"] = {"tracing": {"endpoint": ENDPOINT, **tracing}}
    return parse_spec(spec, cr["metadata"]["name"])


def pod_envs(spec: PDDSpec, owner: Owner) -> dict[str, dict[str, Any]]:
    """Each Deployment's (``<cluster>/<name>``) container env, by variable name."""
    envs = {}
    for cluster, obj in build_plan(spec, owner, TOKEN).children:
        if obj["kind"] == "Deployment":
            (container,) = obj["spec"]["template"]["spec"]["containers"]
            key = f"{cluster}/{obj['metadata']['name']}"
            envs[key] = {e["name"]: e.get("value") for e in container.get("env", [])}
    return envs


def attributes(env: dict[str, Any]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in env["OTEL_RESOURCE_ATTRIBUTES"].split(","))


def test_every_pod_traces_to_the_endpoint_as_its_role(
    pool_b_cr: dict[str, Any], owner: Owner
) -> None:
    envs = pod_envs(traced(pool_b_cr, sampleRatio=0.25), owner)
    expected = {  # Deployment -> (service.name, datacenter, pool)
        "local/qwen-router": ("pdd-router", "A", None),
        "local/qwen-prefill": ("pdd-prefill", "A", "poolA"),
        "local/qwen-relay": ("pdd-relay", "A", "poolA"),
        "local/qwen-main": ("pdd-main", "B", "poolB"),
    }
    assert expected.keys() <= envs.keys()
    for name, (service, dc, pool) in expected.items():
        env = envs[name]
        assert env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == ENDPOINT, name
        assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
        assert float(env["OTEL_TRACES_SAMPLER_ARG"]) == 0.25
        assert env["OTEL_SERVICE_NAME"] == service
        attrs = attributes(env)
        assert attrs["pdd.datacenter"] == dc
        assert attrs.get("pdd.pool") == pool
        assert attrs["k8s.namespace.name"] == "serving"
        assert attrs["k8s.deployment.name"] == name.split("/")[1]
        # kubelet expands $(PDD_INSTANCE_ID): defined before it in the same env list
        assert attrs["k8s.pod.name"] == "$(PDD_INSTANCE_ID)"
        assert list(env).index("PDD_INSTANCE_ID") < list(env).index("OTEL_RESOURCE_ATTRIBUTES")
    assert "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" not in envs.get("local/qwen-redis", {})


def test_md_in_cluster_b_names_its_namespace_and_pool(
    remote_cr: dict[str, Any], owner: Owner
) -> None:
    envs = pod_envs(traced(remote_cr), owner)
    (main,) = [env for name, env in envs.items() if name.startswith("remote/")]
    attrs = attributes(main)
    assert (attrs["pdd.datacenter"], attrs["pdd.pool"]) == ("B", "remoteCluster")
    assert attrs["k8s.namespace.name"] == "serving-b"
    assert float(main["OTEL_TRACES_SAMPLER_ARG"]) == 1.0  # the CRD's default ratio


def test_without_tracing_no_pod_has_otel_env(pool_b_spec: PDDSpec, owner: Owner) -> None:
    for name, env in pod_envs(pool_b_spec, owner).items():
        assert not [k for k in env if k.startswith("OTEL_")], name


def test_traced_deployments_are_valid_kubernetes(
    pool_b_cr: dict[str, Any], remote_cr: dict[str, Any], owner: Owner
) -> None:
    version = kubernetes_validate.latest_version()
    for cr in (pool_b_cr, remote_cr):
        for _, obj in build_plan(traced(cr), owner, TOKEN).children:
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize(
    ("tracing", "text"),
    [
        ({"endpoint": "otel-collector:4318"}, "must be an http:// or https:// URL"),
        ({"endpoint": "grpc://collector:4317"}, "must be an http:// or https:// URL"),
        ({"endpoint": ENDPOINT, "sampleRatio": 1.5}, "observability.tracing.sampleRatio"),
        ({"endpoint": ENDPOINT, "sampleRatio": -0.1}, "observability.tracing.sampleRatio"),
    ],
)
def test_bad_tracing_is_refused_with_the_field(
    pool_b_cr: dict[str, Any], tracing: dict[str, Any], text: str
) -> None:
    spec = {**pool_b_cr["spec"], "observability": {"tracing": tracing}}
    with pytest.raises(InvalidSpecError, match=text):
        parse_spec(spec, "qwen")
