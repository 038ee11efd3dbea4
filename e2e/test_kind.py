"""PDD on a real Kubernetes cluster: kind, the three images, the chart, the node-pool example.

The story: create a kind cluster whose two workers are node pools A and B (labels pool=a and
pool=b), build the worker, router and operator images and load them into the nodes, install
the chart, apply examples/node-pools.yaml, wait for the PDDDeployment's Ready condition,
check P and RLD landed on pool A and MD on pool B, and send one chat completion through a
port-forward to the router.

Needs Docker (a reachable daemon), kind and kubectl; skipped, saying which is missing,
elsewhere. Set PDD_E2E_KEEP_CLUSTER=1 to keep the cluster for debugging.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "pdd"
EXAMPLE = REPO / "examples" / "node-pools.yaml"
KIND_VALUES = REPO / "examples" / "values-kind.yaml"
CLUSTER = "pdd-e2e"
RELEASE = "pdd"
RELEASE_NAMESPACE = "pdd-system"
ROUTER_PORT = 8080
READY_TIMEOUT_S = 900
#: Node pools as the example selects them: role -> the pool label value its pods need.
ROLE_POOLS = {"prefill": "a", "relay": "a", "main": "b"}

KIND_CONFIG = """\
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
nodes:
  - role: control-plane
  - role: worker
    labels:
      pool: a
  - role: worker
    labels:
      pool: b
"""


def missing_tools() -> list[str]:
    """What this machine lacks for the test, each said plainly (empty when all is there)."""
    missing = [
        f"`{tool}` binary not on PATH" for tool in ("kind", "kubectl") if not shutil.which(tool)
    ]
    if not shutil.which("docker"):
        missing.append("`docker` binary not on PATH")
        return missing
    try:
        info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        missing.append("`docker info` timed out: no reachable Docker daemon")
        return missing
    if info.returncode != 0:
        reason = (info.stderr.strip().splitlines() or ["no output"])[-1]
        missing.append(f"`docker info` failed, no Docker daemon ({reason})")
    return missing


_MISSING = missing_tools()
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(bool(_MISSING), reason="kind e2e skipped: " + "; ".join(_MISSING)),
    pytest.mark.timeout(3600),
]


class CommandFailed(RuntimeError):
    """A command exited non-zero; the message carries its output."""


def run(*args: str, kubeconfig: Path | None = None, timeout: float = 900) -> str:
    env = dict(os.environ)
    if kubeconfig is not None:
        env["KUBECONFIG"] = str(kubeconfig)
    done = subprocess.run(
        args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise CommandFailed(
            f"{' '.join(args)} exited {done.returncode}\n{done.stdout[-4000:]}{done.stderr[-4000:]}"
        )
    return done.stdout


@dataclass(frozen=True)
class Images:
    """The image names one source of truth gives: the chart for the operator, the example
    PDDDeployment for the worker and router (the Dockerfiles label the same names)."""

    operator: str
    worker: str
    router: str

    @classmethod
    def from_repo(cls) -> Images:
        image = yaml.safe_load(KIND_VALUES.read_text())["operator"]["image"]
        images = example_deployment()["spec"]["images"]
        operator = f"{image['repository']}:{image['tag']}"
        return cls(operator, images["worker"], images["router"])

    def by_component(self) -> dict[str, str]:
        return {"operator": self.operator, "worker": self.worker, "router": self.router}


def example_deployment() -> dict[str, Any]:
    [doc] = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    return doc


@pytest.fixture(scope="module")
def kubeconfig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh kind cluster with pools A and B; deleted afterwards unless asked to keep it."""
    workdir = tmp_path_factory.mktemp("kind")
    config, path = workdir / "kind.yaml", workdir / "kubeconfig"
    config.write_text(KIND_CONFIG)
    run("kind", "delete", "cluster", "--name", CLUSTER)  # leftovers of an aborted run
    run(
        "kind", "create", "cluster", "--name", CLUSTER, "--config", str(config),
        "--kubeconfig", str(path), "--wait", "180s",
    )  # fmt: skip
    try:
        yield path
    finally:
        if os.environ.get("PDD_E2E_KEEP_CLUSTER") != "1":
            run("kind", "delete", "cluster", "--name", CLUSTER)


@pytest.fixture(scope="module")
def installed(kubeconfig: Path) -> Path:
    """Images built and loaded, the chart installed and its operator rolled out."""
    for component, image in Images.from_repo().by_component().items():
        run("docker", "build", "-f", f"docker/{component}.Dockerfile", "-t", image, ".",
            timeout=3600)  # fmt: skip
        run("kind", "load", "docker-image", image, "--name", CLUSTER)
    helm_install(kubeconfig)
    run(
        "kubectl", "-n", RELEASE_NAMESPACE, "rollout", "status", f"deployment/{RELEASE}-operator",
        "--timeout=300s", kubeconfig=kubeconfig,
    )  # fmt: skip
    return kubeconfig


def helm_install(kubeconfig: Path) -> None:
    """With the helm binary where there is one, else the same Helm through helm-python-sdk."""
    if shutil.which("helm"):
        run(
            "helm", "install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE,
            "--create-namespace", "-f", str(KIND_VALUES), "--wait", "--timeout", "5m",
            kubeconfig=kubeconfig,
        )  # fmt: skip
        return
    import helm_python

    values = helm_python.values_from_yaml(KIND_VALUES.read_text())
    with helm_python.Config(kubeconfig_path=kubeconfig, namespace=RELEASE_NAMESPACE) as helm:
        helm.install(
            CHART, RELEASE, values, namespace=RELEASE_NAMESPACE, create_namespace=True,
            wait="watcher", timeout=300,
        )  # fmt: skip


@pytest.fixture(scope="module")
def ready_deployment(installed: Path) -> dict[str, Any]:
    """The node-pool example applied and Ready (the operator's condition, not a sleep)."""
    cr = example_deployment()
    run("kubectl", "apply", "-f", str(EXAMPLE), kubeconfig=installed)
    try:
        run(
            "kubectl", "-n", cr["metadata"]["namespace"], "wait",
            f"pdddeployment/{cr['metadata']['name']}", "--for=condition=Ready",
            f"--timeout={READY_TIMEOUT_S}s", kubeconfig=installed, timeout=READY_TIMEOUT_S + 60,
        )  # fmt: skip
    except CommandFailed as exc:
        raise AssertionError(f"{exc}\n\n{diagnostics(installed, cr)}") from None
    return cr


def test_roles_run_on_their_node_pools(installed: Path, ready_deployment: dict[str, Any]) -> None:
    namespace, name = (
        ready_deployment["metadata"]["namespace"],
        ready_deployment["metadata"]["name"],
    )
    for role, pool in ROLE_POOLS.items():
        selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/component={role}"
        nodes = run(
            "kubectl", "-n", namespace, "get", "pods", "-l", selector,
            "-o", "jsonpath={.items[*].spec.nodeName}", kubeconfig=installed,
        ).split()  # fmt: skip
        assert nodes, f"no {role} pods"
        for node in nodes:
            label = run(
                "kubectl", "get", "node", node, "-o", "jsonpath={.metadata.labels.pool}",
                kubeconfig=installed,
            )  # fmt: skip
            assert label == pool, f"{role} pod on node {node} of pool {label!r}, wanted {pool!r}"


def test_first_chat_completion_through_the_router(
    installed: Path, ready_deployment: dict[str, Any]
) -> None:
    namespace, name = (
        ready_deployment["metadata"]["namespace"],
        ready_deployment["metadata"]["name"],
    )
    model = ready_deployment["spec"]["model"]["servedName"]
    local_port = free_port()
    env = {**os.environ, "KUBECONFIG": str(installed)}
    forward = subprocess.Popen(
        ["kubectl", "-n", namespace, "port-forward", f"svc/{name}-router",
         f"{local_port}:{ROUTER_PORT}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_for_port(local_port, forward, deadline_s=60)
        response = httpx.post(
            f"http://127.0.0.1:{local_port}/v1/chat/completions",
            json={
                "model": model,
                "messages": [{"role": "user", "content": "Hello from kind"}],
                "max_tokens": 8,
                "temperature": 0,
            },
            timeout=120,
        )
    finally:
        forward.terminate()
        forward.wait(timeout=10)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == model
    assert isinstance(body["choices"][0]["message"]["content"], str)
    assert 1 <= body["usage"]["completion_tokens"] <= 8


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, process: subprocess.Popen[str], deadline_s: float) -> None:
    """Until the port-forward accepts connections; fail with its output if it dies first."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(
                f"port-forward exited: {process.stdout.read() if process.stdout else ''}"
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"port-forward to the router did not open port {port} in {deadline_s}s")


def diagnostics(kubeconfig: Path, cr: dict[str, Any]) -> str:
    """What to read when the deployment never became Ready."""
    namespace, name = cr["metadata"]["namespace"], cr["metadata"]["name"]
    commands = [
        ("kubectl", "get", "pods", "-A", "-o", "wide"),
        ("kubectl", "-n", namespace, "describe", "pdddeployment", name),
        (
            "kubectl",
            "-n",
            RELEASE_NAMESPACE,
            "logs",
            f"deployment/{RELEASE}-operator",
            "--tail=200",
        ),
        ("kubectl", "-n", namespace, "get", "events", "--sort-by=.lastTimestamp"),
    ]
    sections = []
    for command in commands:
        try:
            sections.append(f"$ {' '.join(command)}\n{run(*command, kubeconfig=kubeconfig)}")
        except CommandFailed as exc:
            sections.append(str(exc))
    return "\n".join(sections)
