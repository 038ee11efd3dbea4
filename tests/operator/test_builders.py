"""Pure builders: every child object, checked field by field and against Kubernetes' schemas."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import kubernetes_validate
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from pdd.common.config_document import API_KEYS_ENV, EngineSettings, SloSection, WanKVSettings
from pdd.operator.builders.config import build_worker_config, config_hash
from pdd.operator.builders.deployments import build_worker_deployment
from pdd.operator.builders.hpa import build_relay_hpa, target_quantity
from pdd.operator.builders.meta import Site, with_spec_hash
from pdd.operator.builders.wan_tls import WanTlsMaterial, new_wan_tls, wan_tls_of
from pdd.operator.naming import (
    CONFIG_HASH_ANNOTATION,
    OWNER_UID_LABEL,
    SPEC_HASH_ANNOTATION,
    WAN_TLS_DIR,
    Component,
    Owner,
)
from pdd.operator.plan import Cluster, build_plan, possible_children, ref_of
from pdd.operator.spec import ApiKeysSecret, PDDSpec, WanTls

pytestmark = pytest.mark.unit

TOKEN = "s3cret-token"


def by_kind_name(plan_children: Any) -> dict[tuple[str, str, str], dict[str, Any]]:
    return {(c, o["kind"], o["metadata"]["name"]): o for c, o in plan_children}


def test_every_rendered_object_is_valid_for_current_kubernetes(
    pool_b_spec: PDDSpec, remote_spec: PDDSpec, owner: Owner
) -> None:
    version = kubernetes_validate.latest_version()
    for spec in (pool_b_spec, remote_spec):
        for _, obj in build_plan(spec, owner, TOKEN).children:
            kubernetes_validate.validate(obj, version, strict=True)


def test_pool_placement_node_selectors_tolerations_resources(
    pool_b_spec: PDDSpec, owner: Owner
) -> None:
    children = by_kind_name(build_plan(pool_b_spec, owner, TOKEN).children)
    local = Cluster.LOCAL

    def pod(role: str) -> dict[str, Any]:
        return children[(local, "Deployment", f"qwen-{role}")]["spec"]["template"]["spec"]

    for role in ("prefill", "relay"):
        assert pod(role)["nodeSelector"] == {
            "pool": "prefill",
            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        }
        assert pod(role)["tolerations"] == [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        ]
        # The pool's GPU, the role's default CPU and memory (no CPU limit: no throttling).
        assert pod(role)["containers"][0]["resources"] == {
            "requests": {"cpu": "4", "memory": "16Gi"},
            "limits": {"memory": "64Gi", "nvidia.com/gpu": 1},
        }
    assert pod("main")["nodeSelector"] == {
        "pool": "decode",
        "nvidia.com/gpu.product": "NVIDIA-H200",
    }
    assert pod("main")["tolerations"] == []
    assert "nodeSelector" not in pod("router")  # CPU only: not pinned to a GPU pool
    assert pod("prefill")["containers"][0]["args"] == [
        "worker", "--role", "prefill", "--config", "/etc/pdd/config.json"
    ]  # fmt: skip


def test_replicas_per_role_and_relay_left_to_the_hpa(pool_b_spec: PDDSpec, owner: Owner) -> None:
    children = by_kind_name(build_plan(pool_b_spec, owner, TOKEN).children)
    replicas = {
        role: children[(Cluster.LOCAL, "Deployment", f"qwen-{role}")]["spec"].get("replicas")
        for role in ("prefill", "relay", "main", "router", "redis")
    }
    assert replicas == {"prefill": 2, "relay": None, "main": 3, "router": 2, "redis": 1}


def test_labels_and_owner_references(pool_b_spec: PDDSpec, owner: Owner) -> None:
    for _, obj in build_plan(pool_b_spec, owner, TOKEN).children:
        meta = obj["metadata"]
        assert meta["namespace"] == "serving"
        assert meta["labels"]["app.kubernetes.io/instance"] == "qwen"
        assert meta["labels"][OWNER_UID_LABEL] == owner.uid
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "pdd.dev/v1alpha1",
                "kind": "PDDDeployment",
                "name": "qwen",
                "uid": owner.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        if obj["kind"] == "Deployment":
            selector = obj["spec"]["selector"]["matchLabels"]
            template_labels = obj["spec"]["template"]["metadata"]["labels"]
            assert selector.items() <= template_labels.items()


def test_remote_cluster_objects_have_labels_but_no_owner_refs(
    remote_spec: PDDSpec, owner: Owner
) -> None:
    plan = build_plan(remote_spec, owner, TOKEN)
    remote = [obj for cluster, obj in plan.children if cluster is Cluster.REMOTE]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in remote) == [
        ("ConfigMap", "qwen-config"),
        ("Deployment", "qwen-main"),
        ("PodDisruptionBudget", "qwen-main"),
        ("Secret", "qwen-shared-secret"),
        ("Service", "qwen-main"),
        ("Service", "qwen-main-wan"),
    ]
    for obj in remote:
        assert "ownerReferences" not in obj["metadata"]
        assert obj["metadata"]["namespace"] == "serving-b"
        assert obj["metadata"]["labels"][OWNER_UID_LABEL] == owner.uid
    main = next(o for o in remote if o["kind"] == "Deployment")
    assert main["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "b"}
    local_kinds = {
        (o["kind"], o["metadata"]["name"]) for c, o in plan.children if c is Cluster.LOCAL
    }
    assert ("Deployment", "qwen-main") not in local_kinds
    # Everything planned is something deletion knows how to find.
    for cluster, obj in plan.children:
        namespace = obj["metadata"]["namespace"]
        assert ref_of(cluster, obj) in possible_children(owner, cluster, namespace)


def test_relay_hpa_uses_the_pods_metric(pool_b_spec: PDDSpec, owner: Owner) -> None:
    hpa = build_relay_hpa(pool_b_spec, owner)
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "qwen-relay",
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 3)
    assert hpa["spec"]["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "pdd_worker_relay_load"},
                "target": {"type": "AverageValue", "averageValue": "600m"},
            },
        }
    ]
    assert target_quantity(0.75) == "750m" and target_quantity(1.0) == "1000m"


def test_pdbs_and_headless_services(pool_b_spec: PDDSpec, owner: Owner) -> None:
    children = by_kind_name(build_plan(pool_b_spec, owner, TOKEN).children)
    for role in ("prefill", "relay", "main", "router"):
        pdb = children[(Cluster.LOCAL, "PodDisruptionBudget", f"qwen-{role}")]
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == role
    for role in ("prefill", "relay", "main"):
        service = children[(Cluster.LOCAL, "Service", f"qwen-{role}")]
        assert service["spec"]["clusterIP"] == "None"
        assert [p["port"] for p in service["spec"]["ports"]] == [8000, 9000]
    router = children[(Cluster.LOCAL, "Service", "qwen-router")]
    assert router["spec"]["type"] == "ClusterIP" and router["spec"]["ports"][0]["port"] == 8080


def test_config_map_contents(pool_b_spec: PDDSpec, owner: Owner) -> None:
    children = by_kind_name(build_plan(pool_b_spec, owner, TOKEN).children)
    config = json.loads(
        children[(Cluster.LOCAL, "ConfigMap", "qwen-config")]["data"]["config.json"]
    )
    assert config["model"] == {
        "servedName": "qwen3-8b",
        "path": "/models",
        "kvBytesPerToken": 2 * 36 * 8 * 128 * 2,
    }
    assert config["peers"]["prefill"] == {
        "host": "qwen-prefill.serving.svc",
        "httpPort": 8000,
        "kvPort": 9000,
    }
    assert config["peers"]["router"] == {"host": "qwen-router.serving.svc", "port": 8080}
    assert config["store"] == {"redisUrl": "redis://qwen-redis.serving.svc:6379/0"}
    assert config["handoff"] == {"policy": "auto", "catchUpThreshold": 64}
    assert config["anomalousTraffic"] == {"minInputTokens": 32768, "maxOutputTokens": 500}
    assert config["relay"] == {"targetLoad": 0.6, "loadMetric": "pdd_worker_relay_load"}
    secret = children[(Cluster.LOCAL, "Secret", "qwen-shared-secret")]
    assert base64.b64decode(secret["data"]["token"]).decode() == TOKEN
    env = children[(Cluster.LOCAL, "Deployment", "qwen-prefill")]["spec"]["template"]["spec"][
        "containers"
    ][0]["env"]
    secret_env = next(e for e in env if e["name"] == config["sharedSecretEnv"])
    assert secret_env["valueFrom"]["secretKeyRef"] == {"name": "qwen-shared-secret", "key": "token"}


def test_remote_configs_address_peers_across_clusters(remote_spec: PDDSpec, owner: Owner) -> None:
    seen_from_a = build_worker_config(remote_spec, owner, Site("serving")).to_wire()
    seen_from_b = build_worker_config(remote_spec, owner, Site("serving-b", remote=True)).to_wire()
    assert seen_from_a["peers"]["main"]["host"] == "qwen-main.serving-b.svc.clusterset.local"
    assert seen_from_a["peers"]["relay"]["host"] == "qwen-relay.serving.svc"
    assert seen_from_b["peers"]["main"]["host"] == "qwen-main.serving-b.svc"
    assert seen_from_b["peers"]["relay"]["host"] == "qwen-relay.serving.svc.clusterset.local"
    assert seen_from_a["model"]["path"] == "/opt/model"
    assert seen_from_a["store"] == {"redisUrl": None}


def test_a_config_change_rolls_pods_and_nothing_else_does(
    pool_b_spec: PDDSpec, owner: Owner
) -> None:
    config = build_worker_config(pool_b_spec, owner, Site("serving"))
    changed = pool_b_spec.model_copy(
        update={"handoff": pool_b_spec.handoff.model_copy(update={"catch_up_threshold": 32})}
    )
    new_config = build_worker_config(changed, owner, Site("serving"))
    assert config_hash(config) != config_hash(new_config)
    assert config_hash(config) == config_hash(
        build_worker_config(pool_b_spec, owner, Site("serving"))
    )
    deployment = build_worker_deployment(
        changed, owner, Component.PREFILL, Site("serving"), config_hash(new_config)
    )
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations[CONFIG_HASH_ANNOTATION] == config_hash(new_config)


def test_spec_hash_is_stable_and_sensitive(pool_b_spec: PDDSpec, owner: Owner) -> None:
    first = build_plan(pool_b_spec, owner, TOKEN)
    assert first == build_plan(pool_b_spec, owner, TOKEN)
    obj = first.children[0][1]
    assert with_spec_hash(obj) == obj  # re-annotating an annotated object is a no-op
    more = pool_b_spec.model_copy(
        update={"prefill": pool_b_spec.prefill.model_copy(update={"replicas": 5})}
    )
    before = by_kind_name(first.children)[(Cluster.LOCAL, "Deployment", "qwen-prefill")]
    after = by_kind_name(build_plan(more, owner, TOKEN).children)[
        (Cluster.LOCAL, "Deployment", "qwen-prefill")
    ]
    key = SPEC_HASH_ANNOTATION
    assert before["metadata"]["annotations"][key] != after["metadata"]["annotations"][key]


@pytest.mark.parametrize(
    ("source", "volume"),
    [
        (
            {"pvc": {"claimName": "weights"}},
            {"persistentVolumeClaim": {"claimName": "weights", "readOnly": True}},
        ),
        ({"hostPath": {"path": "/data/m"}}, {"hostPath": {"path": "/data/m", "type": "Directory"}}),
        ({"image": {"path": "/opt/m"}}, None),
    ],
)
def test_model_sources(remote_cr: dict[str, Any], owner: Owner, source: dict, volume: Any) -> None:
    raw = dict(remote_cr["spec"], model={"source": source, "servedName": "m"})
    spec = PDDSpec.model_validate(raw)
    deployment = build_worker_deployment(spec, owner, Component.PREFILL, Site("serving"), "h")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    if volume is None:
        assert "model" not in volumes
    else:
        assert {k: v for k, v in volumes["model"].items() if k != "name"} == volume


def test_each_roles_engine_settings_are_rendered_over_the_shared_ones(
    pool_b_spec: PDDSpec, owner: Owner
) -> None:
    spec = pool_b_spec.model_copy(
        update={
            "engine": EngineSettings(device="auto", kv_cache_memory_fraction=0.9),
            "main_decode": pool_b_spec.main_decode.model_copy(
                update={"engine": EngineSettings(kv_cache_gib=60, max_running_requests=256)}
            ),
            "prefill": pool_b_spec.prefill.model_copy(
                update={"engine": EngineSettings(max_num_batched_tokens=8192)}
            ),
        }
    )
    engine = build_worker_config(spec, owner, Site("serving")).to_wire()["engine"]
    assert engine["main"] == {
        "device": "auto",
        "dtype": None,
        "kvCacheMemoryFraction": None,  # the role's GiB replaces the shared fraction
        "kvCacheGiB": 60,
        "maxRunningRequests": 256,
        "maxModelLen": None,
        "maxPromptTokens": None,
        "maxNumBatchedTokens": None,
        "torchThreads": None,
    }
    assert engine["prefill"]["maxNumBatchedTokens"] == 8192
    assert engine["prefill"]["kvCacheMemoryFraction"] == 0.9
    assert engine["relay"] == {**engine["prefill"], "maxNumBatchedTokens": None}


def test_worker_pods_drain_on_the_specs_schedule(pool_b_spec: PDDSpec, owner: Owner) -> None:
    """Readiness is /ready (false from the first moment of a drain), the grace period
    covers drainSeconds, and the worker is told the same drainSeconds."""
    spec = pool_b_spec.model_copy(update={"drain_seconds": 90})
    for role in (Component.PREFILL, Component.RELAY, Component.MAIN):
        pod = build_worker_deployment(spec, owner, role, Site("serving"), "h")["spec"]["template"]
        container = pod["spec"]["containers"][0]
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert pod["spec"]["terminationGracePeriodSeconds"] == 90 + 10
    assert build_worker_config(spec, owner, Site("serving")).drain_seconds == 90


def test_every_worker_and_router_container_has_its_three_probes_and_requests(
    pool_b_spec: PDDSpec, owner: Owner
) -> None:
    """Each probe on its own endpoint; the startup probe's budget is spec.startupSeconds
    (a model load takes minutes), and liveness waits for it, so a slow load is no restart."""
    spec = pool_b_spec.model_copy(update={"startup_seconds": 1200})
    children = by_kind_name(build_plan(spec, owner, TOKEN).children)
    for role in ("prefill", "relay", "main", "router"):
        (container,) = children[(Cluster.LOCAL, "Deployment", f"qwen-{role}")]["spec"]["template"][
            "spec"
        ]["containers"]
        paths = {p: container[p]["httpGet"]["path"]
                 for p in ("startupProbe", "livenessProbe", "readinessProbe")}  # fmt: skip
        assert paths == {"startupProbe": "/startup", "livenessProbe": "/live",
                         "readinessProbe": "/ready"}  # fmt: skip
        assert {"cpu", "memory"} <= set(container["resources"]["requests"])
        startup = container["startupProbe"]
        budget = startup["periodSeconds"] * startup["failureThreshold"]
        if role == "router":
            assert budget <= 120  # no model to load
        else:
            assert 1200 <= budget < 1200 + startup["periodSeconds"]
        # A wedged pod is restarted within minutes, a busy one is not for one slow answer.
        live = container["livenessProbe"]
        assert live["timeoutSeconds"] >= 2 and live["failureThreshold"] >= 3


def test_a_hub_model_pull_init_container_asks_for_resources_too(
    pool_b_cr: dict, owner: Owner
) -> None:
    """A namespace whose ResourceQuota demands requests refuses a pod any container of
    which has none, init containers included."""
    cr = copy.deepcopy(pool_b_cr["spec"])
    cr["model"]["source"] = {"huggingFace": {"repo": "org/model"}}
    children = by_kind_name(build_plan(PDDSpec.model_validate(cr), owner, TOKEN).children)
    for role in ("prefill", "relay", "main", "router"):
        pod = children[(Cluster.LOCAL, "Deployment", f"qwen-{role}")]["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        assert {"cpu", "memory"} <= set(init["resources"]["requests"])
        kubernetes_validate.validate(
            children[(Cluster.LOCAL, "Deployment", f"qwen-{role}")],
            kubernetes_validate.latest_version(),
            strict=True,
        )


def test_role_resources_lie_over_the_pools_key_by_key(pool_b_cr: dict, owner: Owner) -> None:
    cr = copy.deepcopy(pool_b_cr["spec"])
    cr["prefill"]["resources"] = {"requests": {"cpu": "500m"}, "limits": {"memory": "2Gi"}}
    cr["router"]["resources"] = {"requests": {"cpu": "2", "memory": "2Gi"}}
    children = by_kind_name(build_plan(PDDSpec.model_validate(cr), owner, TOKEN).children)

    def resources(role: str) -> dict[str, Any]:
        pod = children[(Cluster.LOCAL, "Deployment", f"qwen-{role}")]["spec"]["template"]["spec"]
        return pod["containers"][0]["resources"]

    assert resources("prefill") == {
        "requests": {"cpu": "500m"},
        "limits": {"nvidia.com/gpu": 1, "memory": "2Gi"},
    }
    assert resources("relay")["requests"] == {"cpu": "4", "memory": "16Gi"}  # the default
    assert resources("router") == {"requests": {"cpu": "2", "memory": "2Gi"}}


def test_router_takes_client_keys_from_the_named_secret(pool_b_spec: PDDSpec, owner: Owner) -> None:
    def router_env(spec: PDDSpec) -> dict[str, Any]:
        children = by_kind_name(build_plan(spec, owner, TOKEN).children)
        deployment = children[(Cluster.LOCAL, "Deployment", owner.child("router"))]
        return {
            e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        }

    assert API_KEYS_ENV not in router_env(pool_b_spec)  # no Secret named: an open router
    keyed = pool_b_spec.model_copy(
        update={
            "router": pool_b_spec.router.model_copy(
                update={"api_keys_secret": ApiKeysSecret(name="chat-keys")}
            )
        }
    )
    assert router_env(keyed)[API_KEYS_ENV]["valueFrom"] == {
        "secretKeyRef": {"name": "chat-keys", "key": "api-keys"}
    }
    # the keys never enter the config document every pod reads
    assert "chat-keys" not in build_worker_config(keyed, owner, Site(owner.namespace)).to_json()


def test_wan_facing_roles_get_a_service_with_only_their_wan_port(
    pool_b_spec: PDDSpec, owner: Owner
) -> None:
    """Cluster B's peers need RLD's and MD's WAN data port and nothing else: that port has
    a Service of its own to export or admit, the role's Service keeps HTTP and in-datacenter
    data, and P (which no peer reaches across the WAN) has none."""
    children = by_kind_name(build_plan(pool_b_spec, owner, TOKEN).children)
    for role in ("relay", "main"):
        wan = children[(Cluster.LOCAL, "Service", f"qwen-{role}-wan")]
        assert wan["spec"]["ports"] == [{"name": "wan", "port": 9100, "targetPort": "wan"}]
        assert wan["spec"]["clusterIP"] == "None"  # every pod's address, as for the role
        assert wan["spec"]["selector"] == owner.selector_labels(role)
        inside = children[(Cluster.LOCAL, "Service", f"qwen-{role}")]
        assert [p["name"] for p in inside["spec"]["ports"]] == ["http", "kv"]
        pod = children[(Cluster.LOCAL, "Deployment", f"qwen-{role}")]["spec"]["template"]
        ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
        assert ports["wan"] == 9100 and ports["kv"] == 9000
    assert (Cluster.LOCAL, "Service", "qwen-prefill-wan") not in children
    config = json.loads(
        children[(Cluster.LOCAL, "ConfigMap", "qwen-config")]["data"]["config.json"]
    )
    assert config["ports"]["wan"] == 9100 and config["ports"]["kv"] == 9000


@pytest.fixture(scope="module")
def wan_tls() -> WanTlsMaterial:
    return new_wan_tls("qwen")


def with_tls(spec: PDDSpec, **tls: Any) -> PDDSpec:
    wan = spec.wan.model_copy(update={"tls": WanTls(**tls)})
    return spec.model_copy(update={"wan": wan})


def test_wan_tls_secret_goes_to_both_clusters_and_every_worker_mounts_it(
    remote_spec: PDDSpec, owner: Owner, wan_tls: WanTlsMaterial
) -> None:
    spec = with_tls(remote_spec, enabled=True)
    plan = build_plan(spec, owner, TOKEN, wan_tls)
    children = by_kind_name(plan.children)
    secrets = [children[(c, "Secret", "qwen-wan-tls")] for c in (Cluster.LOCAL, Cluster.REMOTE)]
    assert secrets[0]["data"] == secrets[1]["data"]  # one CA: A and B trust each other
    assert secrets[0]["type"] == "kubernetes.io/tls"
    assert wan_tls_of(secrets[1]) == wan_tls  # what the reconciler reads back next time
    version = kubernetes_validate.latest_version()
    for cluster, role in ((Cluster.LOCAL, "prefill"), (Cluster.LOCAL, "relay"),
                          (Cluster.REMOTE, "main")):  # fmt: skip
        pod = children[(cluster, "Deployment", f"qwen-{role}")]["spec"]["template"]["spec"]
        assert {"name": "wan-tls", "secret": {"secretName": "qwen-wan-tls"}} in pod["volumes"]
        (container,) = pod["containers"]
        mount = {"name": "wan-tls", "mountPath": WAN_TLS_DIR, "readOnly": True}
        assert mount in container["volumeMounts"]
        assert container["args"][-2:] == ["--wan-tls-dir", WAN_TLS_DIR]
        # MD's control API crosses the WAN to the router: https, probed and scraped so.
        template = children[(cluster, "Deployment", f"qwen-{role}")]["spec"]["template"]
        scheme = template["metadata"]["annotations"].get("prometheus.io/scheme")
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            get = container[probe]["httpGet"]
            if role == "main":
                assert get["scheme"] == "HTTPS" and scheme == "https"
            else:  # P and RLD share datacenter A with the router: plaintext HTTP
                assert "scheme" not in get and scheme is None
    router = children[(Cluster.LOCAL, "Deployment", "qwen-router")]["spec"]["template"]["spec"]
    # The router verifies MD's certificate: the CA alone, never the workers' private key.
    only_ca = {"secretName": "qwen-wan-tls", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    assert {"name": "wan-tls", "secret": only_ca} in router["volumes"]
    (container,) = router["containers"]
    assert {"name": "wan-tls", "mountPath": WAN_TLS_DIR, "readOnly": True} in container[
        "volumeMounts"
    ]
    assert container["args"][-2:] == ["--wan-tls-dir", WAN_TLS_DIR]
    for cluster, obj in plan.children:
        kubernetes_validate.validate(obj, version, strict=True)
        assert ref_of(cluster, obj) in possible_children(
            owner, cluster, obj["metadata"]["namespace"]
        )
    # Without the material (a render), the workloads still name the Secret it would fill.
    unfilled = by_kind_name(build_plan(spec, owner, None).children)
    assert not [key for key in unfilled if key[1] == "Secret"]
    assert (
        unfilled[(Cluster.REMOTE, "Deployment", "qwen-main")]
        == children[(Cluster.REMOTE, "Deployment", "qwen-main")]
    )


def test_a_named_wan_tls_secret_is_mounted_and_none_generated(
    pool_b_spec: PDDSpec, owner: Owner
) -> None:
    spec = with_tls(pool_b_spec, enabled=True, secret_name="wan-certs")
    children = by_kind_name(build_plan(spec, owner, TOKEN).children)
    assert not [key for key in children if key[1] == "Secret" and key[2] == "qwen-wan-tls"]
    pod = children[(Cluster.LOCAL, "Deployment", "qwen-main")]["spec"]["template"]["spec"]
    assert {"name": "wan-tls", "secret": {"secretName": "wan-certs"}} in pod["volumes"]
    router = children[(Cluster.LOCAL, "Deployment", "qwen-router")]["spec"]["template"]["spec"]
    assert {"name": "wan-tls", "secret": {"secretName": "wan-certs", "items": [
        {"key": "ca.crt", "path": "ca.crt"}]}} in router["volumes"]  # fmt: skip
    off = by_kind_name(build_plan(pool_b_spec, owner, TOKEN).children)
    for role in ("prefill", "main", "router"):  # off by default: no TLS, plaintext probes
        container = off[(Cluster.LOCAL, "Deployment", f"qwen-{role}")]["spec"]["template"]["spec"][
            "containers"
        ][0]
        assert "--wan-tls-dir" not in container["args"]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert "scheme" not in container[probe]["httpGet"]


def test_generated_wan_tls_certificate_is_signed_by_its_ca_for_both_ends(
    wan_tls: WanTlsMaterial,
) -> None:
    ca = x509.load_pem_x509_certificate(wan_tls.ca.encode())
    cert = x509.load_pem_x509_certificate(wan_tls.cert.encode())
    cert.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    other = new_wan_tls("qwen")
    assert other.ca != wan_tls.ca  # a new CA each time: generated once, then read back


def hugging_face_spec(spec: PDDSpec, **source: Any) -> PDDSpec:
    data = spec.model_dump(by_alias=True, exclude_none=True)
    data["model"] = {"servedName": "llm", "source": {"huggingFace": {"repo": "acme/llm", **source}}}
    return PDDSpec.model_validate(data)


def test_a_hugging_face_source_pulls_in_an_init_container_into_the_model_volume(
    remote_spec: PDDSpec, owner: Owner
) -> None:
    spec = hugging_face_spec(remote_spec, revision="v2", tokenSecret={"name": "hf"},
                             endpoint="http://mirror:8080")  # fmt: skip
    children = by_kind_name(build_plan(spec, owner, TOKEN).children)
    version = kubernetes_validate.latest_version()
    for cluster, role in ((Cluster.LOCAL, "prefill"), (Cluster.REMOTE, "main")):
        deployment = children[(cluster, "Deployment", f"qwen-{role}")]
        kubernetes_validate.validate(deployment, version, strict=True)
        pod = deployment["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        assert init["args"] == ["models", "pull", "acme/llm", "--revision", "v2", "--local-dir",
                                "/models", "--termination-log", "/dev/termination-log"]  # fmt: skip
        assert init["env"] == [
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
            {"name": "HF_ENDPOINT", "value": "http://mirror:8080"},
        ]
        assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"
        assert {"name": "model", "emptyDir": {}} in pod["volumes"]
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "model")
        assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}
    router = children[(Cluster.LOCAL, "Deployment", "qwen-router")]["spec"]["template"]["spec"]
    assert router["initContainers"][0]["args"][-1] == "--tokenizer-only"


def test_a_hugging_face_source_with_a_claim_pulls_into_that_pvc(
    pool_b_spec: PDDSpec, owner: Owner
) -> None:
    spec = hugging_face_spec(pool_b_spec, claimName="models")
    children = by_kind_name(build_plan(spec, owner, TOKEN).children)
    pod = children[(Cluster.LOCAL, "Deployment", "qwen-prefill")]["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models"}} in pod["volumes"]
    assert "env" not in pod["initContainers"][0] or pod["initContainers"][0]["env"] == []
    router = children[(Cluster.LOCAL, "Deployment", "qwen-router")]["spec"]["template"]["spec"]
    assert {"name": "model", "emptyDir": {}} in router["volumes"]  # its own, tokenizer only


def test_every_shared_wan_setting_reaches_the_config_document(
    pool_b_cr: dict, owner: Owner
) -> None:
    """spec.wan's WanKVSettings fields, by their CRD names, arrive in the document's ``wan``
    as set (the operator copies the model's fields, not a hand-kept list)."""
    values = {"kvCodec": "int8", "mdRecomputeMaxTokens": 77, "transferTimeoutSeconds": 95.5}
    assert set(values) == {f.alias for f in WanKVSettings.model_fields.values()}
    cr = copy.deepcopy(pool_b_cr)
    cr["spec"]["wan"].update(values)
    wan = build_worker_config(PDDSpec.model_validate(cr["spec"]), owner, Site("s")).to_wire()["wan"]
    assert {key: wan[key] for key in values} == values


def test_every_slo_setting_reaches_the_config_document_and_its_default_is_the_crds(
    pool_b_cr: dict, owner: Owner
) -> None:
    """spec.slo's SloSection fields arrive in the document's ``slo`` as set, and a spec that
    leaves ``slo`` out gives the document the section's own defaults: the CRD's field and the
    document's are one declaration (``Slo`` is a ``SloSection``), not two kept equal by hand."""
    values = {"ttftP99Ms": 1234.5, "tpotMs": 7.5}
    assert set(values) == {f.alias for f in SloSection.model_fields.values()}
    cr = copy.deepcopy(pool_b_cr)
    cr["spec"]["slo"] = values
    slo = build_worker_config(PDDSpec.model_validate(cr["spec"]), owner, Site("s")).to_wire()["slo"]
    assert slo == values
    cr["spec"].pop("slo")
    unset = build_worker_config(PDDSpec.model_validate(cr["spec"]), owner, Site("s")).slo
    assert unset == SloSection()
