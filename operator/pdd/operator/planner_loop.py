"""The planner's thin loop, one kopf daemon per PDDDeployment with ``spec.planner.enabled``:
every interval it scrapes the router's and workers' ``/metrics`` (pods found by their
owner label, in both clusters), steps :class:`~pdd.simulator.planner.scrape.PlannerRound`,
publishes ``pdd_planner_desired_replicas{pdddeployment, role}`` on the
operator's planner metrics endpoint (which a metrics adapter serves to each role's HPA
as an External metric: charts/pdd/templates/metrics-adapter-rules.yaml), and writes the
LineBound condition.

Until its first decision (two scrapes apart) and after the daemon stops, a deployment
publishes no series: an HPA whose metric is missing keeps its replicas, so a planner
that cannot see never scales anything down.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import httpx

from pdd.operator.kube import ApiError, KubeApi
from pdd.operator.naming import COMPONENT_LABEL, OWNER_UID_LABEL, WORKER_ROLES, Component, Owner
from pdd.operator.plan import remote_namespace
from pdd.operator.planner import line_condition, planner_for
from pdd.operator.remote import RemoteClusterUnavailable
from pdd.operator.runtime import OperatorRuntime
from pdd.operator.spec import PDDSpec
from pdd.operator.status import write_status
from pdd.operator.validation import parse_spec
from pdd.operator.worker_reports import pod_url
from pdd.simulator.planner.model_file import load_model
from pdd.simulator.planner.planner import Decision
from pdd.simulator.planner.scrape import MetricsError, PlannerRound, PodMetrics, parse_exposition

#: A pod answers /metrics from its event loop; a slow one is left out of this round.
SCRAPE_TIMEOUT_S = 5.0
_SCRAPED = (*WORKER_ROLES, Component.ROUTER)
#: Between rounds while the spec cannot be read (``spec.planner.intervalSeconds``' default).
DEFAULT_INTERVAL_S = 60.0


async def scrape_targets(
    spec: PDDSpec, owner: Owner, local: KubeApi, remote: KubeApi | None
) -> dict[str, tuple[str, str]]:
    """``pod -> (role, /metrics URL)`` of every ready router and worker pod."""
    places = [(local, owner.namespace)]
    remote_ns = remote_namespace(spec, owner)
    if remote is not None and remote_ns is not None:
        places.append((remote, remote_ns))
    targets: dict[str, tuple[str, str]] = {}
    for api, namespace in places:
        try:
            pods = await api.list("Pod", namespace, {OWNER_UID_LABEL: owner.uid})
        except ApiError as exc:  # cluster B's Role may not grant pods: plan on A's
            if exc.status != 403 or api is local:
                raise
            pods = []
        for pod in pods:
            role = (pod["metadata"].get("labels") or {}).get(COMPONENT_LABEL)
            url = pod_url(pod, "/metrics")
            if role in _SCRAPED and url is not None:
                targets[f"{namespace}/{pod['metadata']['name']}"] = (str(role), url)
    return targets


async def scrape(
    http: httpx.AsyncClient, targets: Mapping[str, tuple[str, str]], logger: logging.Logger
) -> dict[str, PodMetrics]:
    """Every target's metrics at once; a pod that does not answer is left out."""

    async def one(pod: str, role: str, url: str) -> PodMetrics | None:
        try:
            response = await http.get(url, timeout=SCRAPE_TIMEOUT_S)
            response.raise_for_status()
            return parse_exposition(response.text, pod, role)
        except (httpx.HTTPError, MetricsError) as exc:
            logger.debug("planner: no metrics from %s: %s", pod, exc)
            return None

    found = await asyncio.gather(*(one(pod, r, url) for pod, (r, url) in targets.items()))
    return {m.pod: m for m in found if m is not None}


#: A round's spec problems wait for the next round (a fixed spec, a reachable cluster B).
_WAITING = (ValueError, RemoteClusterUnavailable, ApiError)


def planning_key(spec: PDDSpec) -> tuple[Any, ...]:
    """The spec's parts the planner reads: a change in any starts it afresh."""
    return (spec.slo, spec.planner, spec.wan)


def new_round(runtime: OperatorRuntime, spec: PDDSpec) -> PlannerRound:
    """A fresh planner on the scenario's step model and the deployment's own line."""
    line_gbps, rtt_s = spec.wan.declared_gbps, spec.wan.rtt_ms / 1000
    model = load_model(runtime.options.planner_scenario, line_gbps, rtt_s)
    return PlannerRound(planner_for(spec, model))


async def _remote(runtime: OperatorRuntime, owner: Owner, spec: PDDSpec) -> KubeApi | None:
    """Cluster B's client where MD runs there (the operator's cache of them)."""
    if spec.remote_cluster is None:
        return None
    ref = spec.remote_cluster.kubeconfig_secret
    return await runtime.remotes.get(runtime.api, owner.namespace, ref)


async def run_planner(
    runtime: OperatorRuntime, body: Any, owner: Owner, stopped: Any, logger: logging.Logger
) -> None:
    """Plan ``owner`` until ``stopped`` (kopf's daemon flag), reading its live ``body``'s
    spec each round; its series are withdrawn when it stops."""
    planning: tuple[tuple[Any, ...], PlannerRound] | None = None
    try:
        async with httpx.AsyncClient() as http:
            while not stopped and not runtime.stopping:
                interval = runtime.options.planner_interval_s or DEFAULT_INTERVAL_S
                try:
                    spec = parse_spec(dict(body.get("spec") or {}), owner.name)
                    interval = runtime.options.planner_interval_s or spec.planner.interval_seconds
                    if planning is None or planning[0] != planning_key(spec):
                        planning = (planning_key(spec), new_round(runtime, spec))
                    remote = await _remote(runtime, owner, spec)
                    targets = await scrape_targets(spec, owner, runtime.api, remote)
                    scraped = await scrape(http, targets, logger)
                    decision = planning[1].step(scraped, asyncio.get_running_loop().time())
                    if decision is not None:
                        await _act(runtime, owner, decision, logger)
                except _WAITING as exc:
                    logger.warning("planner: this round waits: %s", exc)
                await stopped.wait(interval)
    finally:
        runtime.planner_metrics.forget(owner)


async def _act(
    runtime: OperatorRuntime, owner: Owner, decision: Decision, logger: logging.Logger
) -> None:
    """Publish the decision and write LineBound."""
    runtime.planner_metrics.publish(owner, decision)
    logger.info("planner: desired replicas %s (line bound: %s)", decision.replicas,
                decision.line_bound)  # fmt: skip
    condition = line_condition(decision)
    async with runtime.lock(owner.uid):
        await write_status(runtime.api, owner.namespace, owner.name,
                           lambda _current, _generation: ({}, [condition]))  # fmt: skip
