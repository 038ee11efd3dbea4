"""The SLO planner as the operator runs it, against kmock's Kubernetes emulator: a
PDDDeployment with ``spec.slo`` and ``spec.planner`` renders one HPA per role, the
planner scrapes the router's and workers' metrics (the real metrics modules, served over
HTTP by this test, their pods reported at 127.0.0.1), publishes the desired replicas per
role on the operator's planner endpoint and says when the line is the bottleneck;
switched off, its series go and today's relay HPA comes back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import kopf
import pytest
import yaml
from prometheus_client import start_http_server
from prometheus_client.parser import text_string_to_metric_families

import pdd.operator.handlers  # noqa: F401  (registers the handlers)
from pdd.local.cluster import free_port
from pdd.operator.runtime import OperatorOptions
from pdd.router.metrics import RouterMetrics
from pdd.testing import kube_emulator
from pdd.testing.kube_emulator import CR, HPAS, condition, live
from pdd.testing.waiting import until
from pdd.worker.metrics import WorkerMetrics

pytestmark = pytest.mark.integration

DATA = Path(__file__).parent / "data"
CR_PATH = "/apis/pdd.dev/v1alpha1/namespaces/serving/pdddeployments"
UID = "uid-planner"
PREFILL_MAX, MAIN_MAX = 7, 9


class Fleet:
    """A router and one worker per role, each exporting its real metrics over HTTP."""

    def __init__(self) -> None:
        self.router = RouterMetrics()
        self.workers = {role: WorkerMetrics(role) for role in ("prefill", "relay", "main")}
        self.ports: dict[str, int] = {}
        self.servers: list[Any] = []

    def start(self) -> None:
        registries = {"router": self.router.registry,
                      **{r: w.registry for r, w in self.workers.items()}}  # fmt: skip
        for role, registry in registries.items():
            port = free_port()
            server, _ = start_http_server(port, "127.0.0.1", registry)
            self.ports[role], self.servers = port, [*self.servers, server]

    def stop(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()

    def burst(self, n: int) -> None:
        """``n`` cold requests: every prompt token misses at P and at MD, and crosses."""
        self.router.requests.labels("P-MD", "test").inc(n)
        self.router.tokens.labels("main").inc(900 * n)
        for _ in range(n):
            self.router.ttft.observe(25.0)
        self.workers["prefill"].count_prompt(24000 * n, 0)
        self.workers["main"].count_prompt(24000 * n, 0)


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    f = Fleet()
    f.start()
    try:
        yield f
    finally:
        f.stop()


def ready_pod(role: str, port: int) -> dict[str, Any]:
    """A pod of ``role`` as kubelet reports one running and ready at 127.0.0.1, its
    port named ``http`` as the operator renders it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"qwen-{role}-0", "namespace": "serving",
                     "labels": {"pdd.dev/owner-uid": UID,
                                "app.kubernetes.io/component": role}},
        "spec": {"containers": [{"name": role, "image": "i",
                                 "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {"phase": "Running", "podIP": "127.0.0.1",
                   "conditions": [{"type": "Ready", "status": "True"}]},
    }  # fmt: skip


async def published(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The planner endpoint's desired replicas for ``qwen``, by role."""
    text = (await http.get(url)).text
    return {
        s.labels["role"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "pdd_planner_desired_replicas" and s.labels["pdddeployment"] == "qwen"
    }


async def keep_bursting(fleet: Fleet, stop: asyncio.Event) -> None:
    """Cold traffic far beyond any bound, added in small steps so that every planner
    interval, however the threads interleave, holds some of it."""
    while not stop.is_set():
        fleet.burst(50)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.02)


async def test_metrics_in_desired_replicas_out_and_off_restores_the_relay_hpa(
    cluster_a: Any, fleet: Fleet
) -> None:
    k8s, client = cluster_a
    port = free_port()
    options = OperatorOptions(
        status_interval_s=0.3, planner_metrics_port=port, planner_metrics_host="127.0.0.1",
        planner_interval_s=0.3,
    )  # fmt: skip
    cr = yaml.safe_load((DATA / "pool-b.yaml").read_text())
    cr["metadata"]["uid"] = UID
    cr["spec"]["slo"] = {"ttftP90Seconds": 10, "itlP90Seconds": 0.08}
    cr["spec"]["planner"] = {
        "enabled": True,
        "prefill": {"maxReplicas": PREFILL_MAX},
        "mainDecode": {"minReplicas": 2, "maxReplicas": MAIN_MAX},
    }
    fleet.router.link_goodput.labels("wan").set(10e9 / 8)  # the line measured at 10 Gbit/s
    for role in ("router", "prefill", "relay", "main"):
        pod = ready_pod(role, fleet.ports[role])
        (await client.post("/api/v1/namespaces/serving/pods", json=pod)).raise_for_status()
    url = f"http://127.0.0.1:{port}/metrics"
    stop = asyncio.Event()
    memo = kopf.Memo(options=options)
    async with kube_emulator.running_operator(k8s, memo), httpx.AsyncClient() as http:
        (await client.post(CR_PATH, json=cr)).raise_for_status()
        for role in ("prefill", "relay", "main"):
            hpa = await until(lambda r=role: live(k8s, HPAS, "serving", f"qwen-{r}"), role)
            assert hpa["spec"]["metrics"][0]["type"] == "External"
        traffic = asyncio.create_task(keep_bursting(fleet, stop))
        try:
            wanted = await until(
                lambda: _at_most(published(http, url)), "the planner to ask for every bound"
            )
            assert set(wanted) == {"prefill", "relay", "main"}
            line = await until(
                lambda: (
                    (c := condition(live(k8s, CR, "serving", "qwen"), "LineBound"))
                    and c["status"] == "True"
                    and c
                ),
                "LineBound True (an interval between two bursts may say False first)",
            )
            assert line["reason"] == "WanLineIsTheBottleneck"
        finally:
            stop.set()
            await traffic
        response = await client.patch(
            f"{CR_PATH}/qwen",
            json={"spec": {"planner": {"enabled": False}}},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        response.raise_for_status()
        await until(lambda: _none_left(published(http, url)), "the planner's series withdrawn")
        relay = await until(
            lambda: (
                (h := live(k8s, HPAS, "serving", "qwen-relay"))
                and h["spec"]["metrics"][0]["type"] == "Pods"
                and h
            ),
            "the relay HPA on relay load again",
        )
        assert relay["spec"]["metrics"][0]["pods"]["metric"]["name"] == "pdd_worker_relay_load"


async def _at_most(reading: Any) -> dict[str, float] | None:
    """The published replicas once P and MD are at their maxima (the load is far past
    them), else None."""
    wanted = await reading
    if wanted.get("prefill") == PREFILL_MAX and wanted.get("main") == MAIN_MAX:
        return wanted
    return None


async def _none_left(reading: Any) -> bool:
    return not await reading
