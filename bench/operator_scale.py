"""The operator at scale: many PDDDeployments created at once against kmock's emulator.

    python bench/operator_scale.py [--deployments 100] [--settle-s 5] [--idle-s 30]

(Not ``bench/operator.py``: run as a script, that name would shadow the standard
library's ``operator`` module for every import.)

Runs ``pdd operator`` in-process with its production options (pdd.testing.kube_emulator,
as the operator tests do), creates N PDDDeployments in one burst, and plays the
Deployment controller: each child Deployment is marked ready once it exists. Reported:
seconds until every deployment is reconciled (children and status written) and Ready,
the API calls per deployment that took, by verb; then the calls of the ``--settle-s``
after it (refreshes already woken when the last one turned Ready), and those made while
nothing changes for ``--idle-s`` more (the steady state, which polling would make grow
with N);
then a spec change on one deployment: seconds and calls until it is Ready again.
Only the operator's requests are counted (they carry its token; the bench's do not).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import kmock
import kopf
import yaml

import pdd.operator.handlers  # noqa: F401  (registers the handlers)
from pdd.operator.runtime import OperatorOptions
from pdd.testing.kube_emulator import (
    CR,
    condition,
    emulator,
    kubeconfig,
    live,
    running_operator,
)
from pdd.testing.waiting import until

NAMESPACE = "serving"
CR_PATH = f"/apis/pdd.dev/v1alpha1/namespaces/{NAMESPACE}/pdddeployments"
EXAMPLE = Path(__file__).resolve().parents[1] / "tests" / "operator" / "data" / "pool-b.yaml"
MERGE = {"Content-Type": "application/merge-patch+json"}


def deployment(i: int) -> dict[str, Any]:
    cr = yaml.safe_load(EXAMPLE.read_text())
    cr["metadata"].update(name=f"m{i:03d}", uid=f"uid-m{i:03d}")  # the emulator sets no uid
    return cr


def operator_calls(k8s: kmock.KubernetesEmulator, since: int) -> Counter[str]:
    """The operator's requests since mark ``since``, by Kubernetes action (get, list,
    watch, create, patch, delete)."""
    return Counter(
        r.action.value if r.action is not None else r.method.value
        for r in list(k8s)[since:]
        if r.headers.get("Authorization")
    )


def ready(k8s: kmock.KubernetesEmulator, name: str, prefill: int = 2) -> bool:
    cr = live(k8s, CR, NAMESPACE, name)
    roles = ((cr or {}).get("status") or {}).get("roles") or {}
    return (
        condition(cr, "Ready").get("status") == "True"
        and roles.get("prefill", {}).get("summary") == f"{prefill}/{prefill}"
    )


async def play_deployment_controller(k8s: kmock.KubernetesEmulator, client: httpx.AsyncClient):
    """Mark every child Deployment ready at its desired replicas (what the kubelet and
    the Deployment controller would do), through the API so watches see it."""
    done: dict[str, int] = {}
    while True:
        for (resource, ns, name), obj in list(k8s.objects.items()):
            if resource.plural != "deployments" or obj.deleted:
                continue
            replicas = obj.raw.get("spec", {}).get("replicas", 1)
            if done.get(name) != replicas:
                done[name] = replicas
                status = {"readyReplicas": replicas, "updatedReplicas": replicas}
                path = f"/apis/apps/v1/namespaces/{ns}/deployments/{name}/status"
                await client.patch(path, json={"status": status}, headers=MERGE)
        await asyncio.sleep(0.2)


async def timed(what: Callable[[], bool], name: str) -> float:
    start = time.perf_counter()
    await until(what, name, timeout_s=1800, every_s=0.2)
    return time.perf_counter() - start


def row(label: str, seconds: float | str, calls: Counter[str], per: int) -> str:
    by_verb = " ".join(f"{verb}={n / per:.1f}" for verb, n in sorted(calls.items()))
    secs = f"{seconds:8.2f}" if isinstance(seconds, float) else f"{seconds:>8}"
    return f"| {label:<34} | {secs} | {sum(calls.values()) / per:9.1f} | {by_verb} |"


async def bench(n: int, settle_s: float, idle_s: float) -> None:
    async with emulator() as (k8s, url), httpx.AsyncClient(base_url=url) as client:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "kubeconfig").write_text(kubeconfig(url))
            os.environ["KUBECONFIG"] = str(Path(tmp) / "kubeconfig")
            memo = kopf.Memo(options=OperatorOptions())
            async with running_operator(k8s, memo):
                controller = asyncio.create_task(play_deployment_controller(k8s, client))
                try:
                    await measure(k8s, client, n, settle_s, idle_s)
                finally:
                    controller.cancel()


async def measure(
    k8s: kmock.KubernetesEmulator,
    client: httpx.AsyncClient,
    n: int,
    settle_s: float,
    idle_s: float,
) -> None:
    names = [f"m{i:03d}" for i in range(n)]
    mark = len(list(k8s))
    start = time.perf_counter()
    await asyncio.gather(*(client.post(CR_PATH, json=deployment(i)) for i in range(n)))
    await until(
        lambda: all(condition(live(k8s, CR, NAMESPACE, m), "LinkSized") for m in names),
        "every deployment reconciled",
        timeout_s=1800,
        every_s=0.2,
    )
    reconciled_s = time.perf_counter() - start
    await until(lambda: all(ready(k8s, m) for m in names), "every Ready", 1800, every_s=0.2)
    ready_s = time.perf_counter() - start
    converge = operator_calls(k8s, mark)

    mark = len(list(k8s))
    await asyncio.sleep(settle_s)  # the bench measures load over time; no verdict on it
    settle = operator_calls(k8s, mark)
    mark = len(list(k8s))
    await asyncio.sleep(idle_s)
    idle = operator_calls(k8s, mark)

    mark = len(list(k8s))
    patch = {"spec": {"prefill": {"replicas": 4}}}
    await client.patch(f"{CR_PATH}/{names[0]}", json=patch, headers=MERGE)
    change_s = await timed(lambda: ready(k8s, names[0], prefill=4), "the changed one Ready")
    change = operator_calls(k8s, mark)

    load = os.getloadavg()
    print(f"\n{n} PDDDeployments, operator defaults {OperatorOptions()}")
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1/5/15 min)\n")
    print(f"| {'phase':<34} | {'seconds':>8} | calls/dep | calls/dep by action |")
    print(f"|{'-' * 36}|{'-' * 10}|{'-' * 11}|{'-' * 21}|")
    print(f"| {f'create {n}: all reconciled':<34} | {reconciled_s:8.2f} | {'':>9} | |")
    print(row(f"create {n}: all Ready", ready_s, converge, n))
    print(row(f"the {settle_s:.0f} s after all Ready", "-", settle, n))
    print(row(f"idle {idle_s:.0f} s after that", "-", idle, n))
    print(row("spec change on one: Ready again", change_s, change, 1))
    per_min = sum(idle.values()) / n / idle_s * 60
    print(f"\nsteady state: {per_min:.2f} calls per deployment per minute")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deployments", type=int, default=100)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--idle-s", type=float, default=30.0)
    args = parser.parse_args()
    # kopf names its Events the way the emulator cannot tell apart (409s): not our subject.
    logging.getLogger("kopf").setLevel(logging.ERROR)
    asyncio.run(bench(args.deployments, args.settle_s, args.idle_s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
