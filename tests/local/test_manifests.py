"""Planning pods from rendered manifests, and the network the runner builds: pure parts."""

from __future__ import annotations

import base64
import copy
from typing import Any

import pytest

from pdd.local.cluster import LinkSpec
from pdd.local.manifests import (
    Addressing,
    ClusterObjects,
    ManifestError,
    host_table,
    hosts_file,
    plan_pods,
)
from pdd.testing.pods import Naming, gateway_argv, network_commands

pytestmark = pytest.mark.unit

LABELS = {"app.kubernetes.io/component": "main"}


def deployment(name: str, replicas: int | None = 1, **container: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "template": {
            "metadata": {"labels": {"app.kubernetes.io/component": name}},
            "spec": {"containers": [{"name": name, "image": f"example/{name}:1", **container}]},
        }
    }
    if replicas is not None:
        spec["replicas"] = replicas
    return {"kind": "Deployment", "metadata": {"name": name}, "spec": spec}


def service(name: str, component: str) -> dict[str, Any]:
    return {
        "kind": "Service",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"selector": {"app.kubernetes.io/component": component}},
    }


def test_a_deployment_without_replicas_takes_its_hpas_floor() -> None:
    hpa = {
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "relay"},
        "spec": {"scaleTargetRef": {"name": "relay"}, "minReplicas": 2},
    }
    cluster = ClusterObjects("local", [deployment("relay", replicas=None), hpa])
    pods = plan_pods([cluster])
    assert [p.name for p in pods] == ["relay-0", "relay-1"]
    assert [p.pod_ip for p in pods] == ["10.240.0.1", "10.240.0.2"]
    moved = plan_pods([cluster], addressing=Addressing(100))
    assert (moved[0].pod_ip, moved[0].node_ip) == ("10.100.0.1", "10.101.0.1")


def test_env_is_resolved_as_the_kubelet_would() -> None:
    secret = {
        "kind": "Secret",
        "metadata": {"name": "shared"},
        "data": {"token": base64.b64encode(b"s3cret").decode()},
    }
    env = [
        {"name": "PLAIN", "value": "1"},
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "shared", "key": "token"}}},
        {"name": "KEYS", "valueFrom": {"secretKeyRef": {"name": "user-keys", "key": "k"}}},
    ]
    cluster = ClusterObjects("remote", [deployment("main", env=env), secret])
    other = ClusterObjects("local", [])
    (pod,) = plan_pods([other, cluster], secrets={"user-keys": {"k": "sk-1"}})
    assert pod.env == {
        "PLAIN": "1", "POD": "main-0", "IP": "10.240.1.1", "TOKEN": "s3cret", "KEYS": "sk-1",
    }  # fmt: skip
    assert pod.node_ip == "10.241.1.1"


def test_volumes_become_files_and_host_mounts() -> None:
    config_map = {"kind": "ConfigMap", "metadata": {"name": "cfg"}, "data": {"c.json": "{}"}}
    tls = {
        "kind": "Secret",
        "metadata": {"name": "wan-tls"},
        "data": {
            "tls.crt": base64.b64encode(b"CERT PEM").decode(),
            "ca.crt": base64.b64encode(b"CA PEM").decode(),
        },
    }
    container = {
        "volumeMounts": [
            {"name": "config", "mountPath": "/etc/pdd"},
            {"name": "model", "mountPath": "/models", "subPath": "qwen"},
            {"name": "tls", "mountPath": "/etc/pdd-wan-tls"},
            {"name": "ca", "mountPath": "/etc/ca"},
            {"name": "users", "mountPath": "/etc/users"},
        ]
    }
    dep = deployment("main", **container)
    dep["spec"]["template"]["spec"]["volumes"] = [
        {"name": "config", "configMap": {"name": "cfg"}},
        {"name": "model", "persistentVolumeClaim": {"claimName": "weights"}},
        {"name": "tls", "secret": {"secretName": "wan-tls"}},
        # items: only the keys named, under their paths (the router's CA-only mount)
        {
            "name": "ca",
            "secret": {"secretName": "wan-tls", "items": [{"key": "ca.crt", "path": "root.pem"}]},
        },
        {"name": "users", "secret": {"secretName": "mine"}},  # a user's, given to the runner
    ]
    cluster = ClusterObjects("local", [dep, config_map, tls])
    (pod,) = plan_pods([cluster], claims={"weights": "/data/w"}, secrets={"mine": {"k": "v"}})
    assert pod.files == {
        "/etc/pdd": {"c.json": "{}"},
        "/etc/pdd-wan-tls": {"tls.crt": "CERT PEM", "ca.crt": "CA PEM"},
        "/etc/ca": {"root.pem": "CA PEM"},
        "/etc/users": {"k": "v"},
    }
    assert pod.host_mounts == {"/models": "/data/w/qwen"}
    with pytest.raises(ManifestError, match="PersistentVolumeClaim 'weights'"):
        plan_pods([cluster], secrets={"mine": {"k": "v"}})


def test_a_probe_keeps_its_scheme_and_the_pod_serves_http_as_its_probe_says() -> None:
    """MD with WAN TLS on: kubelet probes its control API over https, so does the runner."""
    probe = {"httpGet": {"path": "/ready", "port": "http", "scheme": "HTTPS"}}
    ports = [{"name": "http", "containerPort": 8000}]
    main = deployment("main", ports=ports, readinessProbe=probe)
    plain = deployment("prefill", ports=ports, readinessProbe={"httpGet": {"port": "http"}})
    tcp = deployment("redis", ports=ports, readinessProbe={"tcpSocket": {"port": "http"}})
    pods = {p.component: p for p in plan_pods([ClusterObjects("local", [main, plain, tcp])])}
    assert pods["main"].http_scheme == "https"
    assert pods["main"].probe is not None
    assert pods["main"].probe.url("10.0.0.1", 8000) == "https://10.0.0.1:8000/ready"
    assert pods["prefill"].http_scheme == "http"
    assert pods["prefill"].probe is not None
    assert pods["prefill"].probe.url("10.0.0.1", 8000) == "http://10.0.0.1:8000/"
    assert pods["redis"].probe is not None
    assert pods["redis"].probe.url("10.0.0.1", 8000) == "tcp://10.0.0.1:8000"


def test_gpu_requests_are_refused_with_the_fix() -> None:
    dep = deployment("main", resources={"limits": {"nvidia.com/gpu": 1}})
    with pytest.raises(ManifestError, match=r"nvidia.com/gpu.*drop the pool's GPU resources"):
        plan_pods([ClusterObjects("local", [dep])])


def test_names_resolve_to_pods_in_their_cluster_and_across_by_the_clusterset_domain() -> None:
    local = ClusterObjects("local", [deployment("prefill", 2), service("p", "prefill")])
    remote = ClusterObjects("remote", [deployment("main"), service("m", "main")])
    pods = plan_pods([local, remote])
    tables = host_table([local, remote], pods, "clusterset.local")
    assert tables["local"]["p.ns.svc"] == ["10.240.0.1", "10.240.0.2"]
    assert tables["local"]["m.ns.svc.clusterset.local"] == ["10.240.1.1"]
    assert "m.ns.svc" not in tables["local"]
    assert tables["remote"]["m.ns.svc.cluster.local"] == ["10.240.1.1"]
    assert "10.240.0.2 p.ns.svc\n" in hosts_file(tables["local"])


def test_each_gateway_forwards_the_other_clusters_ports_it_may_reach() -> None:
    ports = [
        {"name": n, "containerPort": p} for n, p in (("http", 8000), ("kv", 9000), ("wan", 9100))
    ]
    local = ClusterObjects("local", [deployment("relay", ports=copy.deepcopy(ports))])
    remote = ClusterObjects("remote", [deployment("main", ports=copy.deepcopy(ports))])
    pods = plan_pods([local, remote])
    link = LinkSpec(gbps=1, rtt_ms=20, jitter_ms=0)
    a_side = gateway_argv(link, 0, pods, Addressing())
    assert a_side[:5] == ["wan-link", "--listen", "10.240.1.1:8000", "--to", "10.241.1.1:8000"]
    assert a_side[-2:] == ["--route", "10.240.1.1:9100=10.241.1.1:9100"]
    b_side = gateway_argv(
        link, 1, pods, Addressing()
    )  # B reaches A's WAN port only, never kv or http
    assert b_side[:5] == ["wan-link", "--listen", "10.240.0.1:9100", "--to", "10.241.0.1:9100"]
    assert "--route" not in b_side
    commands = network_commands(Naming("t"), 2, pods, Addressing())
    # Each gateway holds only the other cluster's pod IPs, on its own cluster's bridge.
    held = [c for c in commands if c[:3] == ["ip", "-n", "pdd-t-wan0"] and "/32" in c[-3]]
    assert held == [["ip", "-n", "pdd-t-wan0", "addr", "add", "10.240.1.1/32", "dev", "pdtw00"]]


def test_a_program_missing_from_the_path_is_found_beside_the_interpreter(
    tmp_path, monkeypatch
) -> None:
    """An unactivated ``.venv/bin/pdd up`` runs the redis-server setup put in .venv/bin."""
    import sys

    from pdd.local.manifests import find_program

    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "redis-server").write_text("#!/bin/sh\n")
    (venv_bin / "redis-server").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_program("redis-server") == str(venv_bin / "redis-server")
    assert find_program("no-such-program") is None
    system_bin = tmp_path / "system"
    system_bin.mkdir()
    (system_bin / "redis-server").write_text("#!/bin/sh\n")
    (system_bin / "redis-server").chmod(0o755)
    monkeypatch.setenv("PATH", str(system_bin))
    assert find_program("redis-server") == str(system_bin / "redis-server")  # the system's wins
