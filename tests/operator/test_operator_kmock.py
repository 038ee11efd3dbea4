"""The operator end to end in-process: kopf against kmock's Kubernetes emulators.

One emulator per cluster (A, and B for the remote variant). kopf logs in through the
operator's own login handler, which reads KUBECONFIG, pointed at emulator A; cluster B
is reached through a kubeconfig Secret, exactly as in a real deployment. The emulator
has no controllers and assigns no uids, so tests set uids and play the Deployment
controller by patching status where they need readiness.
"""

from __future__ import annotations

import base64
import copy
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import httpx
import kmock
import kopf
import pytest
import yaml

import pdd.operator.handlers  # noqa: F401  (registers the handlers)
from pdd.common.cost_model import DTYPE_BYTES, kv_bytes_per_token
from pdd.local.cluster import free_port
from pdd.operator.main import peering_options
from pdd.operator.runtime import OperatorOptions
from pdd.testing import kube_emulator
from pdd.testing.kube_emulator import (
    CHILD_RESOURCES,
    CR,
    DEPLOYMENTS,
    HPAS,
    VERBS,
    condition,
    emulator,
    kubeconfig,
    live,
)
from pdd.testing.waiting import until, until_sync

DATA = Path(__file__).parent / "data"
#: Fast rounds for tests; the readiness test that must not depend on polling sets its own.
TEST_OPTIONS = OperatorOptions(
    status_interval_s=0.3, remote_retry_delay_s=0.5, remote_cleanup_retries=1
)

pytestmark = pytest.mark.integration


def versions(k8s: kmock.KubernetesEmulator, resource: str, ns: str, name: str) -> int:
    return len(k8s.objects[resource, ns, name].history)


def children(k8s: kmock.KubernetesEmulator, ns: str) -> list[tuple[str, str]]:
    found = []
    for resource in CHILD_RESOURCES:
        names = (
            "config",
            "shared-secret",
            "wan-tls",
            "prefill",
            "relay",
            "main",
            "router",
            "redis",
        )
        for name in names:
            for prefix in ("qwen", "remote"):
                if live(k8s, resource, ns, f"{prefix}-{name}") is not None:
                    found.append((resource, f"{prefix}-{name}"))
    return found


def events(k8s: kmock.KubernetesEmulator, reason: str) -> list[dict]:
    return [
        r.data
        for r in list(k8s)
        if r.resource is not None and r.resource.plural == "events" and r.method == "POST"
        if (r.data or {}).get("reason") == reason
    ]


def running_operator(
    k8s: kmock.KubernetesEmulator,
    name: str = "kopf",
    options: OperatorOptions = TEST_OPTIONS,
    **peering: Any,
) -> AbstractAsyncContextManager[None]:
    """The shared in-process operator (pdd.testing.kube_emulator) with test options."""
    return kube_emulator.running_operator(k8s, kopf.Memo(options=options), name, **peering)


def load_cr(name: str, uid: str) -> dict[str, Any]:
    cr = yaml.safe_load((DATA / name).read_text())
    cr["metadata"]["uid"] = uid  # the emulator does not assign uids
    return cr


async def create(client: httpx.AsyncClient, path: str, obj: dict[str, Any]) -> None:
    response = await client.post(path, json=obj)
    response.raise_for_status()


CR_PATH = "/apis/pdd.dev/v1alpha1/namespaces/serving/pdddeployments"


def reconciled(requests: list[Any]) -> bool:
    """Has a reconcile walked every child (the router PDB is planned last) and then read
    the PDDDeployment back to write its status?"""
    plurals = [(r.resource.plural, r.name) for r in requests if r.resource is not None]
    if ("poddisruptionbudgets", "qwen-router") not in plurals:
        return False
    last_child = plurals.index(("poddisruptionbudgets", "qwen-router"))
    return ("pdddeployments", "qwen") in plurals[last_child:]


async def mark_every_role_ready(client: Any) -> None:
    """Play the Deployment controller: every child Deployment of ``qwen`` reports its
    replicas ready (pool-b.yaml's counts)."""
    for role, ready in (("prefill", 2), ("relay", 1), ("main", 3), ("router", 2)):
        path = f"/apis/apps/v1/namespaces/serving/deployments/qwen-{role}/status"
        status = {"status": {"readyReplicas": ready, "updatedReplicas": ready}}
        (await client.patch(path, json=status)).raise_for_status()


async def degraded_condition(k8s: Any, name: str) -> dict[str, Any]:
    """The PDDDeployment's Degraded condition, once the operator has set one."""
    return await until(lambda: condition(live(k8s, CR, "serving", name), "Degraded"), "Degraded")


async def test_create_then_reconcile_again_changes_nothing(cluster_a: Any) -> None:
    """Including the generated WAN TLS Secret: read back on a restart, never regenerated."""
    k8s, client = cluster_a
    cr = load_cr("pool-b.yaml", "uid-qwen")
    cr["spec"]["wan"]["tls"] = {"enabled": True}
    async with running_operator(k8s):
        await create(client, CR_PATH, cr)
        main = await until(lambda: live(k8s, DEPLOYMENTS, "serving", "qwen-main"), "MD")
        pod = main["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"pool": "decode", "nvidia.com/gpu.product": "NVIDIA-H200"}
        assert main["metadata"]["ownerReferences"][0]["uid"] == "uid-qwen"
        hpa = await until(lambda: live(k8s, HPAS, "serving", "qwen-relay"), "the relay HPA")
        assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "pdd_worker_relay_load"
        cr = await until(
            lambda: (c := live(k8s, CR, "serving", "qwen")) and condition(c, "LinkSized") and c,
            "LinkSized",
        )
        assert condition(cr, "LinkSized")["status"] == "True"
        assert cr["status"]["wan"]["declaredGbps"] == 25
        assert condition(cr, "Ready")["reason"] == "ReplicasNotReady"

        # Every role ready -> Ready=True via the daemon.
        await mark_every_role_ready(client)
        await until(
            lambda: condition(live(k8s, CR, "serving", "qwen"), "Ready").get("status") == "True",
            "Ready=True",
        )
        cr = live(k8s, CR, "serving", "qwen")
        assert cr["status"]["roles"]["main"]["summary"] == "3/3"
        built = children(k8s, "serving")
        assert ("v1/secrets", "qwen-wan-tls") in built
        history = {key: versions(k8s, key[0], "serving", key[1]) for key in built}

    mark = len(list(k8s))
    async with running_operator(k8s):  # a restart: kopf resumes and reconciles again
        await until(lambda: reconciled(list(k8s)[mark:]), "the resumed reconcile to finish")
    writes = [
        (r.method, r.resource.plural, r.name)
        for r in list(k8s)[mark:]
        if r.resource is not None and r.resource.plural not in ("pdddeployments", "events")
        if r.method in ("POST", "PATCH", "PUT", "DELETE")
    ]
    assert writes == []
    assert {key: versions(k8s, key[0], "serving", key[1]) for key in built} == history
    assert sorted(built) == sorted(children(k8s, "serving"))


async def test_readiness_follows_child_deployment_events_not_a_timer(cluster_a: Any) -> None:
    """With an hour between polls, only the child Deployments' watch events can bring
    Ready=True: a per-PDDDeployment timer would load the API server even when idle."""
    k8s, client = cluster_a
    hourly = OperatorOptions(status_interval_s=3600.0, status_interval_max_s=3600.0)
    async with running_operator(k8s, options=hourly):
        await create(client, CR_PATH, load_cr("pool-b.yaml", "uid-qwen"))
        await until(lambda: reconciled(list(k8s)), "the first reconcile to finish")
        assert condition(live(k8s, CR, "serving", "qwen"), "Ready")["status"] == "False"
        await mark_every_role_ready(client)
        await until(
            lambda: condition(live(k8s, CR, "serving", "qwen"), "Ready").get("status") == "True",
            "Ready=True from the Deployments' events",
        )
        assert live(k8s, CR, "serving", "qwen")["status"]["roles"]["main"]["summary"] == "3/3"


async def test_spec_change_updates_and_rolls_the_affected_children(cluster_a: Any) -> None:
    k8s, client = cluster_a
    async with running_operator(k8s):
        await create(client, CR_PATH, load_cr("pool-b.yaml", "uid-qwen"))
        before = await until(lambda: live(k8s, DEPLOYMENTS, "serving", "qwen-prefill"), "prefill")
        await until(
            lambda: live(k8s, "policy/v1/poddisruptionbudgets", "serving", "qwen-router"), "all"
        )
        hpa_versions = versions(k8s, HPAS, "serving", "qwen-relay")
        config_key = "pdd.dev/config-hash"
        old_hash = before["spec"]["template"]["metadata"]["annotations"][config_key]
        patch = {"spec": {"prefill": {"replicas": 4}, "handoff": {"catchUpThreshold": 32}}}
        mark = len(list(k8s))
        response = await client.patch(
            f"{CR_PATH}/qwen",
            json=patch,
            headers={"Content-Type": "application/merge-patch+json"},
        )
        response.raise_for_status()
        after = await until(
            lambda: (
                (d := live(k8s, DEPLOYMENTS, "serving", "qwen-prefill"))
                and d["spec"]["replicas"] == 4
                and d
            ),
            "prefill scaled to 4",
        )
        assert after["spec"]["template"]["metadata"]["annotations"][config_key] != old_hash
        await until(  # the relay reads the same config: it rolls too
            lambda: (
                (d := live(k8s, DEPLOYMENTS, "serving", "qwen-relay"))
                and d["spec"]["template"]["metadata"]["annotations"][config_key] != old_hash
            ),
            "the relay's pods to roll",
        )
        await until(lambda: reconciled(list(k8s)[mark:]), "the reconcile to finish")
        config = live(k8s, "v1/configmaps", "serving", "qwen-config")
        assert '"catchUpThreshold": 32' in config["data"]["config.json"]
        assert versions(k8s, HPAS, "serving", "qwen-relay") == hpa_versions


async def test_undersized_link_is_reported_with_an_event(cluster_a: Any) -> None:
    k8s, client = cluster_a
    cr = load_cr("pool-b.yaml", "uid-small")
    cr["spec"]["wan"]["declaredGbps"] = 1
    async with running_operator(k8s):
        await create(client, CR_PATH, cr)
        linked = await until(
            lambda: condition(live(k8s, CR, "serving", "qwen"), "LinkSized"), "LinkSized"
        )
        assert (linked["status"], linked["reason"]) == ("False", "LinkUndersized")
        warning = (await until(lambda: events(k8s, "LinkUndersized"), "the event"))[0]
        assert warning["type"] == "Warning" and "raise wan.declaredGbps" in warning["message"]
        assert live(k8s, DEPLOYMENTS, "serving", "qwen-main") is not None  # deploys anyway


async def test_invalid_spec_gets_a_clear_condition_and_no_children(cluster_a: Any) -> None:
    k8s, client = cluster_a
    cr = load_cr("pool-b.yaml", "uid-bad")
    cr["spec"]["relay"] = {"minReplicas": 3, "maxReplicas": 2}
    async with running_operator(k8s):
        await create(client, CR_PATH, cr)
        degraded = await degraded_condition(k8s, "qwen")
        assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")
        assert "relay.maxReplicas (2) is below minReplicas (3)" in degraded["message"]
        assert condition(live(k8s, CR, "serving", "qwen"), "Ready")["status"] == "False"
        await until(lambda: events(k8s, "InvalidSpec"), "the InvalidSpec event")
        assert children(k8s, "serving") == []


async def test_remote_cluster_waits_for_its_secret_then_deploys_and_deletes_both(
    cluster_a: Any,
) -> None:
    k8s_a, client_a = cluster_a
    cr = load_cr("remote.yaml", "uid-remote")
    cr["spec"]["wan"]["tls"] = {"enabled": True}
    async with emulator() as (k8s_b, url_b), running_operator(k8s_a):
        await create(client_a, CR_PATH, cr)
        blocked = await degraded_condition(k8s_a, "remote")
        assert blocked["reason"] == "RemoteClusterUnavailable"
        assert "kubectl -n serving create secret generic cluster-b" in blocked["message"]
        assert children(k8s_a, "serving") == []  # nothing half-way

        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "cluster-b", "namespace": "serving", "uid": "uid-secret"},
            "data": {"kubeconfig": base64.b64encode(kubeconfig(url_b).encode()).decode()},
        }
        await create(client_a, "/api/v1/namespaces/serving/secrets", secret)
        main = await until(lambda: live(k8s_b, DEPLOYMENTS, "serving-b", "remote-main"), "MD in B")
        assert "ownerReferences" not in main["metadata"]
        assert main["metadata"]["labels"]["pdd.dev/owner-uid"] == "uid-remote"
        assert main["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "b"}
        await until(lambda: live(k8s_a, DEPLOYMENTS, "serving", "remote-router"), "router")
        assert live(k8s_a, DEPLOYMENTS, "serving", "remote-main") is None
        token_a = live(k8s_a, "v1/secrets", "serving", "remote-shared-secret")["data"]
        token_b = live(k8s_b, "v1/secrets", "serving-b", "remote-shared-secret")["data"]
        assert token_a == token_b
        tls_a = live(k8s_a, "v1/secrets", "serving", "remote-wan-tls")["data"]
        tls_b = live(k8s_b, "v1/secrets", "serving-b", "remote-wan-tls")["data"]
        assert tls_a == tls_b and set(tls_a) == {"tls.crt", "tls.key", "ca.crt"}
        volumes = main["spec"]["template"]["spec"]["volumes"]
        assert {"name": "wan-tls", "secret": {"secretName": "remote-wan-tls"}} in volumes
        await until(
            lambda: (
                condition(live(k8s_a, CR, "serving", "remote"), "Degraded").get("status") == "False"
            ),
            "Degraded=False once cluster B is reachable",
        )

        (await client_a.delete(f"{CR_PATH}/remote")).raise_for_status()
        await until(lambda: live(k8s_a, CR, "serving", "remote") is None, "the CR to go")
        assert children(k8s_b, "serving-b") == []
        assert children(k8s_a, "serving") == []


async def test_a_missing_wan_tls_secret_blocks_with_a_condition_until_it_exists(
    cluster_a: Any,
) -> None:
    k8s, client = cluster_a
    cr = load_cr("pool-b.yaml", "uid-qwen")
    cr["spec"]["wan"]["tls"] = {"enabled": True, "secretName": "wan-certs"}
    async with running_operator(k8s):
        await create(client, CR_PATH, cr)
        blocked = await degraded_condition(k8s, "qwen")
        assert (blocked["status"], blocked["reason"]) == ("True", "WanTlsSecretInvalid")
        assert "Secret serving/wan-certs in cluster A does not exist" in blocked["message"]
        assert children(k8s, "serving") == []  # nothing half-way: pods could not start
        pem = {k: base64.b64encode(b"pem").decode() for k in ("tls.crt", "tls.key", "ca.crt")}
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "wan-certs", "namespace": "serving", "uid": "uid-certs"},
            "data": pem,
        }
        await create(client, "/api/v1/namespaces/serving/secrets", secret)
        main = await until(lambda: live(k8s, DEPLOYMENTS, "serving", "qwen-main"), "MD")
        volumes = main["spec"]["template"]["spec"]["volumes"]
        assert {"name": "wan-tls", "secret": {"secretName": "wan-certs"}} in volumes
        assert live(k8s, "v1/secrets", "serving", "qwen-wan-tls") is None  # none generated


#: An exec credential plugin, as EKS/GKE/AKS kubeconfigs name (`aws eks get-token`...): it
#: counts its runs in a file and prints an ExecCredential with a token naming the run.
EXEC_PLUGIN = """#!{python}
import json, os, pathlib
runs = pathlib.Path({runs!r})
count = len(runs.read_text()) + 1 if runs.exists() else 1
runs.write_text("x" * count)
info = json.loads(os.environ["KUBERNETES_EXEC_INFO"])  # what the client passes a plugin
assert info["kind"] == "ExecCredential", info
print(json.dumps({{"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
                  "status": {{"token": f"exec-token-{{count}}"}}}}))
"""


def exec_plugin_kubeconfig(url: str, plugin: Path) -> str:
    user = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": str(plugin),
            "args": ["get-token", "--cluster", "b"],
            "interactiveMode": "Never",
        }
    }
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "b",
            "contexts": [{"name": "b", "context": {"cluster": "b", "user": "cloud"}}],
            "clusters": [{"name": "b", "cluster": {"server": url}}],
            "users": [{"name": "cloud", "user": user}],
        }
    )


async def test_cluster_b_is_reached_through_an_exec_plugin_kubeconfig(
    cluster_a: Any, tmp_path: Path
) -> None:
    """A cloud kubeconfig: the user is an exec plugin, run by the client library, and
    every request to cluster B carries the token it printed; MD is reconciled there."""
    k8s_a, client_a = cluster_a
    runs, plugin = tmp_path / "runs", tmp_path / "get-token"
    plugin.write_text(EXEC_PLUGIN.format(python=sys.executable, runs=str(runs)))
    plugin.chmod(0o755)
    async with emulator() as (k8s_b, url_b), running_operator(k8s_a):
        config = exec_plugin_kubeconfig(url_b, plugin)
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "cluster-b", "namespace": "serving", "uid": "uid-secret"},
            "data": {"kubeconfig": base64.b64encode(config.encode()).decode()},
        }
        await create(client_a, "/api/v1/namespaces/serving/secrets", secret)
        await create(client_a, CR_PATH, load_cr("remote.yaml", "uid-exec"))
        main = await until(lambda: live(k8s_b, DEPLOYMENTS, "serving-b", "remote-main"), "MD in B")
        assert main["metadata"]["labels"]["pdd.dev/owner-uid"] == "uid-exec"
        await until(
            lambda: (
                condition(live(k8s_a, CR, "serving", "remote"), "Degraded").get("status") == "False"
            ),
            "the reconcile to finish with cluster B written",
        )
        assert runs.read_text() == "x"  # one run: a token without expiry is kept
        to_b = [r for r in list(k8s_b) if r.resource is not None]
        assert to_b and {r.headers.get("Authorization") for r in to_b} == {"Bearer exec-token-1"}


async def test_moving_md_back_from_cluster_b_cleans_cluster_b(cluster_a: Any) -> None:
    k8s_a, client_a = cluster_a
    async with emulator() as (k8s_b, url_b), running_operator(k8s_a):
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "cluster-b", "namespace": "serving", "uid": "uid-secret"},
            "data": {"kubeconfig": base64.b64encode(kubeconfig(url_b).encode()).decode()},
        }
        await create(client_a, "/api/v1/namespaces/serving/secrets", secret)
        cr = load_cr("remote.yaml", "uid-move")
        await create(client_a, CR_PATH, copy.deepcopy(cr))
        await until(lambda: live(k8s_b, DEPLOYMENTS, "serving-b", "remote-main"), "MD in B")
        response = await client_a.patch(
            f"{CR_PATH}/remote",
            json={"spec": {"remoteCluster": None, "poolB": {"nodeSelector": {"pool": "b2"}}}},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        response.raise_for_status()
        await until(lambda: live(k8s_a, DEPLOYMENTS, "serving", "remote-main"), "MD in A")
        await until(lambda: children(k8s_b, "serving-b") == [], "cluster B to be emptied")


PEERINGS = "kopf.dev/v1/clusterkopfpeerings"


class OperatorLogs(logging.Handler):
    """kopf's log records, told apart by the thread (operator) that wrote them."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def said(self, operator: str, text: str, since: int = 0) -> bool:
        return any(
            r.threadName == operator and text in r.getMessage() for r in self.records[since:]
        )

    def handled_objects(self, since: int = 0) -> set[str]:
        """The operators that ran a handler on an object (kopf logs "... succeeded.")."""
        return {
            r.threadName
            for r in self.records[since:]
            if r.name.startswith("kopf.objects") and r.getMessage().endswith("succeeded.")
        }


@pytest.fixture
def operator_logs() -> Iterator[OperatorLogs]:
    logs = OperatorLogs()
    kopf_logger = logging.getLogger("kopf")
    level = kopf_logger.level
    kopf_logger.addHandler(logs)
    kopf_logger.setLevel(logging.DEBUG)
    yield logs
    kopf_logger.removeHandler(logs)
    kopf_logger.setLevel(level)


async def test_two_replicas_with_peering_reconcile_one_at_a_time(
    cluster_a: Any, operator_logs: OperatorLogs
) -> None:
    """Two `pdd operator --peering` replicas: the one of higher priority reconciles, the
    other stands by paused; when the active one stops, the standby takes over."""
    k8s, client = cluster_a
    k8s.resources[PEERINGS] = {"kind": "ClusterKopfPeering", "namespaced": False, "verbs": VERBS}
    peering = {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering"}
    peering["metadata"] = {"name": "pdd-operator", "uid": "uid-peering"}
    await create(client, "/apis/kopf.dev/v1/clusterkopfpeerings", peering)
    options = peering_options("pdd-operator")
    watch = "Starting the watch-stream for pdddeployments"

    async with running_operator(k8s, "standby", **{**options, "priority": 100}):
        await until(lambda: operator_logs.said("standby", watch), "the first replica to watch")
        async with running_operator(k8s, "active", **{**options, "priority": 200}):
            await until(
                lambda: operator_logs.said("standby", "Pausing operations in favour of"),
                "the lower-priority replica to pause",
            )
            await until(lambda: operator_logs.said("active", watch), "the active replica to watch")
            await create(client, CR_PATH, load_cr("pool-b.yaml", "uid-qwen"))
            await until(
                lambda: (
                    live(k8s, "policy/v1/poddisruptionbudgets", "serving", "qwen-router")
                    and operator_logs.handled_objects()
                ),
                "a replica to build every child",
            )
            assert operator_logs.handled_objects() == {"active"}
            paused = len(operator_logs.records)
        # The active replica stopped (and left the peering): the standby takes over.
        stopped = len(operator_logs.records)
        await until(
            lambda: operator_logs.said("standby", "Resuming operations", since=paused),
            "the standby to resume",
        )
        patch = {"spec": {"prefill": {"replicas": 4}}}
        response = await client.patch(
            f"{CR_PATH}/qwen", json=patch, headers={"Content-Type": "application/merge-patch+json"}
        )
        response.raise_for_status()
        await until(
            lambda: (
                (live(k8s, DEPLOYMENTS, "serving", "qwen-prefill") or {})["spec"]["replicas"] == 4
            ),
            "the standby to reconcile the change",
        )
        await until(lambda: operator_logs.handled_objects(since=stopped), "a handler to run")
        assert operator_logs.handled_objects(since=stopped) == {"standby"}


def pulling_pod(name: str, uid: str, terminated: dict[str, Any], last: bool) -> dict[str, Any]:
    """A pod as kubelet reports one whose model-pull init container ended (``last``: it
    failed and is waiting to be restarted)."""
    status = {"name": "model-pull", "state": {"terminated": terminated}}
    if last:
        status = {"name": "model-pull", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                  "lastState": {"terminated": terminated}}  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "serving",
                     "labels": {"pdd.dev/owner-uid": uid}},
        "spec": {"initContainers": [{"name": "model-pull", "image": "w"}],
                 "containers": [{"name": "prefill", "image": "w"}]},
        "status": {"initContainerStatuses": [status]},
    }  # fmt: skip


async def test_a_refused_hub_token_becomes_a_model_available_condition(cluster_a: Any) -> None:
    """A huggingFace source without a KV shape: pods get the pull init container; its
    termination message ("TokenRejected: ...") is the condition's reason, and a
    successful pull turns it True, woken by the pods' events."""
    k8s, client = cluster_a
    cr = load_cr("pool-b.yaml", "uid-hf")
    cr["spec"]["model"] = {
        "source": {"huggingFace": {"repo": "acme/llm", "tokenSecret": {"name": "hf"}}},
        "servedName": "llm",
    }
    hourly = OperatorOptions(status_interval_s=3600.0, status_interval_max_s=3600.0)
    async with running_operator(k8s, options=hourly):
        await create(client, CR_PATH, cr)
        prefill = await until(lambda: live(k8s, DEPLOYMENTS, "serving", "qwen-prefill"), "P")
        (init,) = prefill["spec"]["template"]["spec"]["initContainers"]
        assert init["args"][:3] == ["models", "pull", "acme/llm"]
        linked = await until(
            lambda: condition(live(k8s, CR, "serving", "qwen"), "LinkSized"), "LinkSized"
        )
        assert linked["reason"] == "KVSizeUnknown"  # no shape given: not sized, not refused
        refused = {"exitCode": 1, "message": "TokenRejected: the hub rejected the token (401)"}
        await create(client, "/api/v1/namespaces/serving/pods",
                     pulling_pod("qwen-prefill-x", "uid-hf", refused, last=True))  # fmt: skip
        model = await until(
            lambda: (
                (c := condition(live(k8s, CR, "serving", "qwen"), "ModelAvailable"))
                and c["status"] == "False"
                and c
            ),
            "ModelAvailable=False",
        )
        assert model["reason"] == "TokenRejected"
        assert "qwen-prefill-x" in model["message"] and "acme/llm@main" in model["message"]
        pulled = pulling_pod("qwen-prefill-x", "uid-hf", {"exitCode": 0}, last=False)
        response = await client.patch(
            "/api/v1/namespaces/serving/pods/qwen-prefill-x/status",
            json={"status": pulled["status"]},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        response.raise_for_status()
        await until(
            lambda: (
                condition(live(k8s, CR, "serving", "qwen"), "ModelAvailable").get("reason")
                == "Pulled"
            ),
            "ModelAvailable=True once the pull succeeded",
        )


@pytest.fixture
def tiny_prefill_worker(tmp_path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """A real ``pdd worker`` (prefill, the ``tiny`` model) on a local port, and its
    ``/health`` body once it serves."""
    port = free_port()
    argv = [sys.executable, "-m", "pdd.cli", "worker", "--role", "prefill", "--model", "tiny",
            "--instance-id", "qwen-prefill-a", "--http", f"127.0.0.1:{port}",
            "--data", f"127.0.0.1:{free_port()}", "--num-blocks", "16",
            "--torch-threads", "1", "--drain-seconds", "0",
            "--drain-notice-seconds", "0"]  # fmt: skip
    log = tmp_path / "worker.log"
    env = {**os.environ, "PDD_SHARED_SECRET": "s3cret"}
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:

        def health() -> dict[str, Any] | None:
            assert proc.poll() is None, log.read_text()
            try:
                answer = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
            except httpx.HTTPError:
                return None
            return answer.json() if answer.status_code == 200 else None

        yield port, until_sync(health, "the tiny prefill worker serving /health", 300, 0.2)
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def ready_worker_pod(name: str, uid: str, port: int) -> dict[str, Any]:
    """A prefill pod as kubelet reports one running and ready at 127.0.0.1 (the worker
    process above), its control port named ``http`` as the operator renders it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "serving",
                     "labels": {"pdd.dev/owner-uid": uid,
                                "app.kubernetes.io/component": "prefill"}},
        "spec": {"containers": [{"name": "prefill", "image": "w",
                                 "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {"phase": "Running", "podIP": "127.0.0.1",
                   "conditions": [{"type": "Ready", "status": "True"}]},
    }  # fmt: skip


async def test_without_a_kv_shape_the_link_is_sized_from_what_a_worker_reports(
    cluster_a: Any, tiny_prefill_worker: tuple[int, dict[str, Any]]
) -> None:
    """No model.config: LinkSized is Unknown (KVSizeUnknown) until a prefill pod is ready;
    its readiness wakes the operator, which reads the worker's /health and sizes the
    link with the KV shape the worker loaded, saying which pod reported it."""
    k8s, client = cluster_a
    port, health = tiny_prefill_worker
    cr = load_cr("pool-b.yaml", "uid-kv")
    del cr["spec"]["model"]["config"]
    hourly = OperatorOptions(status_interval_s=3600.0, status_interval_max_s=3600.0)
    async with running_operator(k8s, options=hourly):
        await create(client, CR_PATH, cr)
        linked = await until(
            lambda: condition(live(k8s, CR, "serving", "qwen"), "LinkSized"), "LinkSized"
        )
        assert linked["reason"] == "KVSizeUnknown"
        assert "prefill pod reports" in linked["message"]
        await create(client, "/api/v1/namespaces/serving/pods",
                     ready_worker_pod("qwen-prefill-a", "uid-kv", port))  # fmt: skip
        # the Deployment controller's part: the pod being ready counts in readyReplicas
        path = "/apis/apps/v1/namespaces/serving/deployments/qwen-prefill/status"
        ready = {"status": {"readyReplicas": 1, "updatedReplicas": 1}}
        (await client.patch(path, json=ready)).raise_for_status()
        sized = await until(
            lambda: (
                (c := condition(live(k8s, CR, "serving", "qwen"), "LinkSized"))
                and c["reason"] != "KVSizeUnknown"
                and c
            ),
            "LinkSized from the reported shape",
        )
        assert sized["reason"] in ("LinkSufficient", "LinkUndersized")
        wan = live(k8s, CR, "serving", "qwen")["status"]["wan"]
        shape = health["engine"]["kv_shape"]
        assert wan["kvShapeReportedBy"] == "qwen-prefill-a"
        assert wan["kvBytesPerToken"] == shape["bytes_per_token"] == kv_bytes_per_token(
            shape["num_layers"], shape["num_kv_heads"], shape["head_dim"],
            DTYPE_BYTES[shape["dtype"]],
        )  # fmt: skip
        assert "requiredGbps" in wan


async def test_the_planner_scales_every_role_through_its_own_hpa_and_off_restores_today(
    cluster_a: Any,
) -> None:
    """spec.planner on: one HPA per role on pdd_planner_desired_replicas{role}, worker
    Deployments without replicas; switched off again: the relay HPA on relay load."""
    k8s, client = cluster_a
    cr = load_cr("pool-b.yaml", "uid-qwen")
    cr["spec"]["slo"] = {"ttftP90Seconds": 10, "itlP90Seconds": 0.08}
    cr["spec"]["planner"] = {"enabled": True, "mainDecode": {"maxReplicas": 32}}
    async with running_operator(k8s):
        await create(client, CR_PATH, cr)
        for role in ("prefill", "relay", "main"):
            hpa = await until(lambda r=role: live(k8s, HPAS, "serving", f"qwen-{r}"), role)
            metric = hpa["spec"]["metrics"][0]
            assert metric["external"]["metric"]["selector"]["matchLabels"]["role"] == role
        assert live(k8s, HPAS, "serving", "qwen-main")["spec"]["maxReplicas"] == 32
        assert "replicas" not in live(k8s, DEPLOYMENTS, "serving", "qwen-prefill")["spec"]
        response = await client.patch(
            f"{CR_PATH}/qwen",
            json={"spec": {"planner": {"enabled": False}}},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        response.raise_for_status()
        relay = await until(
            lambda: (
                (h := live(k8s, HPAS, "serving", "qwen-relay"))
                and h["spec"]["metrics"][0]["type"] == "Pods"
                and h
            ),
            "the relay HPA on relay load again",
        )
        assert relay["spec"]["metrics"][0]["pods"]["metric"]["name"] == "pdd_worker_relay_load"
        await until(lambda: live(k8s, HPAS, "serving", "qwen-prefill") is None, "P's HPA gone")
        await until(
            lambda: (
                (live(k8s, DEPLOYMENTS, "serving", "qwen-prefill") or {})
                .get("spec", {})
                .get("replicas")
                is not None
            ),
            "P's fixed replicas back",
        )
