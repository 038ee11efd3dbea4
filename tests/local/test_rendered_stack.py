"""What the operator renders is what runs: both examples, as rendered, on local processes.

``pdd operator render``'s pure core turns each example into manifests, which run two ways:
``pdd.testing.pods`` (root) runs every container's exact command line, environment and
mounted config, each pod in its own network namespace with the Service names of its
cluster; ``pdd.local.hostnet`` (what ``pdd up`` uses, no privileges) runs them on the
host's loopback with only the pod network's part given as flags. In the two-cluster
example the only data path between the clusters is ``pdd wan-link``. A request through
the rendered router must produce mono's tokens, and both P-MD and P-RLD-MD must serve.

What the test changes in the examples, and why (nothing else): the model becomes the
built-in ``tiny`` one (no checkpoint can be downloaded here), GPU requests go (no GPU
here; the engine's ``device: auto`` then picks the CPU, as on a CPU pool), and the
declared link and TTFT SLO are set so that a long prompt's KV cannot cross in time
(P-RLD-MD) while a short one's can (P-MD).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pdd.common.tokenizer import ByteTokenizer
from pdd.common.vocabulary import COMPONENT_LABEL
from pdd.local.cluster import LinkSpec
from pdd.local.hostnet import start_host_pods
from pdd.local.manifests import ClusterObjects, HostAddressing, plan_pods
from pdd.operator.render import render_file
from pdd.testing.pods import RunningPods, start_pods
from pdd.testing.waiting import until_sync

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY_MODEL = {
    "servedName": "tiny",
    "source": {"image": {"path": "tiny"}},
    "config": {"numLayers": 4, "numKVHeads": 2, "headDim": 32, "dtype": "float32"},
}
#: 0.01 Gbit/s declared and a 150 ms SLO: 2 KiB of tiny-model KV per token makes a
#: 300-token prompt's transfer ~0.5 s (too slow: P-RLD-MD) and a 12-token one's ~20 ms.
DIALS = {"wan": {"declaredGbps": 0.01, "rttMs": 10}, "slo": {"ttftP99Ms": 150}}
LINK = LinkSpec(gbps=0.05, rtt_ms=10.0, jitter_ms=0.0)
LONG, SHORT = 300, 12
KV_BYTES_PER_TOKEN = 4 * 2 * 32 * 2 * 4  # layers x KV heads x head dim x (K, V) x float32
MAX_TOKENS = 16


def netns_unavailable() -> str | None:
    """Why pods cannot get their network here (namespaces, veth, bridges), or None."""
    tag = uuid.uuid4().hex[:6]
    ns, bridge, veth = f"pdd-probe-{tag}", f"pdp{tag}b", f"pdp{tag}v"
    steps = [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", bridge, "type", "bridge"],
        ["ip", "link", "add", veth, "type", "veth", "peer", "name", f"pdp{tag}w", "netns", ns],
        ["ip", "link", "set", veth, "master", bridge],
    ]
    try:
        for argv in steps:
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode != 0:
                return f"needs root with netns, veth and bridges (`{shlex.join(argv)}`): " + (
                    done.stderr.strip()
                )
        return None
    except FileNotFoundError as exc:
        return f"needs iproute2's `ip`: {exc}"
    finally:
        for argv in (["ip", "link", "del", veth], ["ip", "link", "del", bridge]):
            subprocess.run(argv, capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def for_this_machine(doc: dict[str, Any]) -> dict[str, Any]:
    spec = doc["spec"]
    spec["model"] = TINY_MODEL
    pools = [spec.get("poolA"), spec.get("poolB"), (spec.get("remoteCluster") or {}).get("pool")]
    for pool in filter(None, pools):
        pool.pop("resources", None)
    spec["wan"].update(DIALS["wan"])  # keeps the example's wan.tls
    spec["slo"] = DIALS["slo"]
    return doc


def rendered(example: str) -> list[ClusterObjects]:
    docs = [d for d in yaml.safe_load_all((EXAMPLES / example).read_text()) if d]
    docs = [for_this_machine(d) if d["kind"] == "PDDDeployment" else d for d in docs]
    text = yaml.safe_dump_all(docs)
    by_cluster = render_file(text)
    secrets = render_file(text, secrets_token="rendered-stack-test")  # the operator's, once
    return [ClusterObjects(str(c), objs + secrets[c]) for c, objs in by_cluster.items()]


@dataclass
class Stack:
    """A running rendered stack, whichever runner started it."""

    router_url: str
    pods_by_role: dict[str, int]
    #: The A-to-B line's stats URL (two clusters), else None.
    a_to_b_stats: str | None
    #: Where each pod's log is (``<pod name>.log``).
    log_dir: Path
    #: Each MD pod's control API as the runner reaches it (its probe's scheme: https with
    #: WAN TLS on).
    main_urls: list[str]

    def worker_logs(self) -> dict[str, str]:
        """Each worker pod's log, by pod name."""
        roles = ("-prefill-", "-relay-", "-main-")
        return {
            log.stem: log.read_text()
            for log in self.log_dir.glob("*.log")
            if any(role in log.stem for role in roles)
        }


def in_namespaces(clusters: list[ClusterObjects], log_dir: Path) -> Iterator[Stack]:
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    image_env = {**os.environ, "OMP_NUM_THREADS": "1"}
    running: RunningPods = start_pods(clusters, log_dir, link=LINK, image_env=image_env)
    try:
        (router, *_) = running.with_label(COMPONENT_LABEL, "router")
        roles = Counter(p.component for p in running.pods)
        a_side = f"{running.gateway_admins[0]}/stats" if running.gateway_admins else None
        mains = [
            f"{p.http_scheme}://{p.node_ip}:{p.ports['http']}"
            for p in running.with_label(COMPONENT_LABEL, "main")
        ]
        router_url = f"http://{router.node_ip}:{router.ports['http']}"
        yield Stack(router_url, roles, a_side, log_dir, mains)
    finally:
        running.stop()


def on_host(clusters: list[ClusterObjects], log_dir: Path) -> Iterator[Stack]:
    plans = plan_pods(clusters, addressing=HostAddressing())
    running = start_host_pods(plans, log_dir, link=LINK, env={"OMP_NUM_THREADS": "1"})
    try:
        (router, *_) = running.of_role("router")
        roles = Counter(p.role for p in running.pods)
        a_side = f"{running.lines[0].admin_url}/stats" if running.lines else None
        mains = [p.http_url for p in running.of_role("main")]
        yield Stack(router.http_url, roles, a_side, log_dir, mains)
    finally:
        running.stop()


RUNNERS = {"netns": in_namespaces, "hostnet": on_host}


@pytest.fixture(
    params=[
        (example, runner)
        for runner in ("hostnet", "netns")
        for example in ("node-pools.yaml", "two-clusters.yaml")
    ],
    ids=lambda p: f"{p[1]}-{p[0].removesuffix('.yaml')}",
    scope="module",
)
def stack(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[Stack]:
    example, runner = request.param
    log_dir = tmp_path_factory.mktemp(f"{runner}-{example.removesuffix('.yaml')}")
    yield from RUNNERS[runner](rendered(example), log_dir)


def router_sees_every_worker(url: str, stack: Stack) -> bool:
    """The router's ``pdd_router_instances_ready`` per role equals the pods of that role."""
    ready: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("pdd_router_instances_ready{"):
            labels, value = line.split("} ")
            ready[labels.split('role="')[1].split('"')[0]] = float(value)
    return all(
        ready.get(role, 0) == stack.pods_by_role[role] for role in ("prefill", "relay", "main")
    )


def mono_ids(prompt: list[int]) -> list[int]:
    """Greedy IDs from one colocated engine (``pdd generate``), the ground truth."""
    argv = ["generate", "--model", "tiny", "--max-tokens", str(MAX_TOKENS), "--json"]
    argv += ["--prompt-ids", ",".join(map(str, prompt))]
    out = subprocess.run([sys.executable, "-m", "pdd.cli", *argv], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["token_ids"]


def pipelines_served(url: str) -> dict[str, float]:
    served: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("pdd_router_requests_total{"):
            labels, value = line.split("} ")
            pipeline = labels.split('pipeline="')[1].split('"')[0]
            served[pipeline] = served.get(pipeline, 0) + float(value)
    return served


def test_rendered_pods_serve_monos_tokens_on_both_pipelines(stack: Stack) -> None:
    url = stack.router_url
    until_sync(
        lambda: router_sees_every_worker(url, stack),
        "the rendered router to see every worker pod (a relay it has not seen is saturated)",
        timeout_s=120,
    )
    tokenizer = ByteTokenizer()
    with httpx.Client(base_url=f"{url}/v1", timeout=120) as client:
        for n, length in enumerate((LONG, SHORT)):
            prompt = [(7 * n + 31 * i) % 250 + 1 for i in range(length)]
            body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            answer = client.post("/completions", json=body)
            assert answer.status_code == 200, answer.text
            expected = tokenizer.decode(mono_ids(prompt))
            assert answer.json()["choices"][0]["text"] == expected
    served = pipelines_served(url)
    assert served.get("P-RLD-MD", 0) >= 1 and served.get("P-MD", 0) >= 1, served
    # The two-cluster example turns WAN TLS on: every worker served its WAN port with
    # (mutual) TLS, so the KV and handoffs above crossed encrypted; the other runs plaintext.
    secured = {name: "(TLS 1.3, mutual)" in log for name, log in stack.worker_logs().items()}
    assert len(secured) == sum(stack.pods_by_role[r] for r in ("prefill", "relay", "main"))
    assert set(secured.values()) == {stack.a_to_b_stats is not None}, secured
    # The router's calls to MD (its token stream above, handoffs, polls) crossed on https
    # there: MD's control API serves TLS only, so a plaintext client gets nothing from it.
    tls = stack.a_to_b_stats is not None
    for main in stack.main_urls:
        assert main.startswith("https://" if tls else "http://"), main
        assert httpx.get(f"{main}/health", verify=False, timeout=10).status_code == 200
        if tls:
            plain = main.replace("https://", "http://", 1)
            with pytest.raises(httpx.HTTPError):
                httpx.get(f"{plain}/health", timeout=10)
    mains = [log for name, log in stack.worker_logs().items() if "-main-" in name]
    assert mains and all(f"{'https' if tls else 'http'} on" in log for log in mains)
    if stack.a_to_b_stats:  # two clusters: the KV goes to MD over the emulated line
        a_side = stack.a_to_b_stats
        until_sync(  # a relay may finish before the long prompt's KV has landed at MD
            lambda: (
                httpx.get(a_side, timeout=10).json()["forward"]["bytes"]
                >= LONG * KV_BYTES_PER_TOKEN
            ),
            "the long prompt's KV to cross the A-to-B line",
        )
