"""The chart renders and lints with real Helm, and its schema turns bad values away by name."""

from __future__ import annotations

from typing import Any

import helm_python
import pytest
import yaml

from pdd.operator.main import parse_args
from pdd.operator.naming import Owner
from pdd.operator.plan import build_plan
from pdd.operator.spec import PDDSpec

pytestmark = pytest.mark.unit

#: helm lint severities: 1 info (e.g. "icon is recommended"), 2 warning, 3 error.
WARNING = 2


def test_chart_lints_clean_in_strict_mode(chart, chart_values: dict[str, Any] | None) -> None:
    report = helm_python.lint(chart.path, chart_values, strict=True, namespace=chart.namespace)
    assert report["errors"] == []
    findings = [m for m in report["messages"] if m["severity"] >= WARNING]
    assert findings == []


def test_chart_renders_the_operator_and_its_identity(chart, find_object, chart_values) -> None:
    objects = chart.objects(chart_values)
    pod = find_object(objects, "Deployment", "pdd-operator")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "pdd-operator"
    find_object(objects, "ServiceAccount", "pdd-operator")
    role = find_object(objects, "ClusterRole", "pdd-operator")
    binding = find_object(objects, "ClusterRoleBinding", "pdd-operator")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "pdd-operator", "namespace": chart.namespace}
    ]


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"replicaCount": "two"}, "/replicaCount"),
        ({"replicaCount": 2, "operator": {"peering": {"enabled": False}}}, "/operator/peering"),
        ({"redis": {"port": "6379"}}, "/redis/port"),
        ({"redis": {"enabeld": True}}, "enabeld"),
        ({"operator": {"image": {"repository": "Not An Image!"}}}, "/operator/image/repository"),
        ({"operator": {"statusIntervalSeconds": 0}}, "/operator/statusIntervalSeconds"),
    ],
    ids=[
        "wrong-type",
        "two-standalone-operators",
        "port-as-string",
        "typo-key",
        "bad-image",
        "zero-interval",
    ],
)
def test_schema_rejects_bad_values_naming_the_field(chart, values, field: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as err:
        chart.render(values)
    assert field in str(err.value)
    report = helm_python.lint(chart.path, values, strict=True)
    assert any(field in message for message in report["errors"]), report["errors"]


def test_managed_redis_renders_a_service_that_selects_its_pod(chart, find_object) -> None:
    objects = chart.objects({"redis": {"enabled": True, "port": 6380}})
    service = find_object(objects, "Service", "pdd-redis")
    redis = find_object(objects, "Deployment", "pdd-redis")
    assert service["spec"]["ports"][0]["port"] == 6380
    assert redis["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] == 6380
    pod_labels = redis["spec"]["template"]["metadata"]["labels"]
    assert pod_labels.items() >= service["spec"]["selector"].items()
    notes = chart.render({"redis": {"enabled": True, "port": 6380}})["templates/NOTES.txt"]
    assert f"redis://pdd-redis.{chart.namespace}.svc:6380/0" in notes


def test_without_managed_redis_nothing_redis_renders(chart) -> None:
    objects = chart.objects()
    assert [o["metadata"]["name"] for o in objects if "redis" in o["metadata"]["name"]] == []


def test_operator_args_are_ones_pdd_operator_accepts(chart, find_object, chart_values) -> None:
    container = _operator_container(chart.objects(chart_values), find_object)
    args = parse_args(container["args"])
    assert args.liveness.endswith(f":{container['ports'][0]['containerPort']}/healthz")
    probe = container["livenessProbe"]["httpGet"]
    assert (probe["path"], probe["port"]) == ("/healthz", container["ports"][0]["name"])
    watched = (chart_values or {}).get("operator", {}).get("watchNamespaces", [])
    assert args.namespace == watched
    assert args.all_namespaces is (not watched)


def test_operator_interval_comes_from_values(chart, find_object) -> None:
    container = _operator_container(chart.objects({"operator": {"statusIntervalSeconds": 5}}),
                                    find_object)  # fmt: skip
    assert parse_args(container["args"]).status_interval == 5.0


def test_overridden_images_render_with_their_repository_tag_and_pull_policy(
    chart, find_object
) -> None:
    """What docs/kubernetes.md shows: a private mirror for each image of the chart."""
    values = {
        "operator": {"image": {"repository": "registry.local:5000/pdd/operator", "tag": "dev",
                               "pullPolicy": "Always"}},
        "redis": {"enabled": True, "image": {"repository": "mirror.local/redis", "tag": "7.4.1",
                                             "pullPolicy": "Never"}},
    }  # fmt: skip
    report = helm_python.lint(chart.path, values, strict=True, namespace=chart.namespace)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= WARNING] == []
    objects = chart.objects(values)
    images = {}
    for name in ("pdd-operator", "pdd-redis"):
        pod = find_object(objects, "Deployment", name)["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        images[name] = (container["image"], container["imagePullPolicy"])
    assert images == {
        "pdd-operator": ("registry.local:5000/pdd/operator:dev", "Always"),
        "pdd-redis": ("mirror.local/redis:7.4.1", "Never"),
    }
    # Only the repository given: the tag stays the chart's appVersion.
    only_repo = {"operator": {"image": {"repository": "mirror.local/pdd-operator"}}}
    container = _operator_container(chart.objects(only_repo), find_object)
    assert container["image"] == "mirror.local/pdd-operator:0.1.0"


def test_operator_runs_locked_down(chart, find_object) -> None:
    pod = find_object(chart.objects(), "Deployment", "pdd-operator")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    container = pod["containers"][0]["securityContext"]
    assert container["allowPrivilegeEscalation"] is False
    assert container["readOnlyRootFilesystem"] is True


def test_notes_print_the_redis_url_and_the_adapter_hand_off(chart) -> None:
    notes = chart.render({"redis": {"enabled": True}})["templates/NOTES.txt"]
    assert f"redis://pdd-redis.{chart.namespace}.svc:6379/0" in notes
    assert "rules.existing=pdd-adapter-rules" in notes
    assert "/v1/chat/completions" in notes


def _operator_container(objects, find_object) -> dict[str, Any]:
    deployment = find_object(objects, "Deployment", "pdd-operator")
    return deployment["spec"]["template"]["spec"]["containers"][0]


def test_operator_replicas_meet_in_the_peering_the_chart_creates(chart, find_object) -> None:
    objects = chart.objects()
    operator = find_object(objects, "Deployment", "pdd-operator")
    assert operator["spec"]["replicas"] == 2
    assert operator["spec"]["strategy"]["type"] == "RollingUpdate"
    args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
    peering = args[args.index("--peering") + 1]
    assert find_object(objects, "ClusterKopfPeering", peering)
    alone = chart.objects({"replicaCount": 1, "operator": {"peering": {"enabled": False}}})
    operator = find_object(alone, "Deployment", "pdd-operator")
    assert "--peering" not in operator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert operator["spec"]["strategy"]["type"] == "Recreate"  # never two at once
    assert not [o for o in alone if o["kind"] == "ClusterKopfPeering"]
    role = find_object(alone, "ClusterRole", "pdd-operator")
    assert all("kopf.dev" not in rule["apiGroups"] for rule in role["rules"])


def test_network_policy_admits_cluster_b_to_the_wan_port_only(chart, find_object) -> None:
    values = {
        "networkPolicy": {"enabled": True, "namespaces": ["serving"], "wanPeers": ["10.20.0.0/16"]}
    }
    policy = find_object(chart.objects(values), "NetworkPolicy", "pdd-workers")
    assert policy["metadata"]["namespace"] == "serving"
    rules = policy["spec"]["ingress"]
    inside, wan = rules
    assert inside["from"] == [{"podSelector": {}}]
    assert {p["port"] for p in inside["ports"]} == {"http", "kv", "wan"}
    assert wan == {"from": [{"ipBlock": {"cidr": "10.20.0.0/16"}}], "ports": [{"port": "wan"}]}
    # the names are ports the operator declares on every worker container it renders
    cr = next(d for d in yaml.safe_load_all((chart.examples / "node-pools.yaml").read_text()) if d)
    owner = Owner(name=cr["metadata"]["name"], namespace="serving", uid="u")
    for cluster, obj in build_plan(PDDSpec.model_validate(cr["spec"]), owner, "t").children:
        if obj["kind"] == "Deployment" and obj["metadata"]["name"].endswith(
            ("prefill", "relay", "main")
        ):
            declared = {
                p["name"] for p in obj["spec"]["template"]["spec"]["containers"][0]["ports"]
            }
            assert {"http", "kv", "wan"} <= declared
    assert not [o for o in chart.objects() if o["kind"] == "NetworkPolicy"]  # off by default
    with pytest.raises(Exception, match="networkPolicy.namespaces"):
        chart.objects({"networkPolicy": {"enabled": True}})
