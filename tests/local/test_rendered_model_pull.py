"""A huggingFace model source, rendered and run by ``pdd up``'s runner (hostnet): each
pod's init container pulls the repo from a fake hub over local HTTP through
huggingface_hub, then the workers serve it and the router answers with it; a refused
token stops the start with the init container's reason."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pdd.local.cluster import LinkSpec
from pdd.local.hostnet import HostPodsStartError, start_host_pods
from pdd.local.manifests import ClusterObjects, HostAddressing, plan_pods
from pdd.operator.render import render_file
from pdd.testing.fake_hub import FakeHub

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LINK = LinkSpec(gbps=1.0, rtt_ms=1.0, jitter_ms=0.0)
_spec = importlib.util.spec_from_file_location(
    "pdd_test_checkpoints", Path(__file__).parents[1] / "worker" / "checkpoints.py"
)
checkpoints = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checkpoints)


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Any:
    root = tmp_path_factory.mktemp("hub")
    (root / "acme").mkdir()
    ckpt = checkpoints.write_hf_checkpoint(root / "acme", "qwen3")
    ckpt.rename(root / "acme" / "tiny-qwen3")
    server = FakeHub(root, token="s3cret").start()
    yield server
    server.stop()


def rendered(hub: FakeHub) -> list[ClusterObjects]:
    docs = [d for d in yaml.safe_load_all((EXAMPLES / "node-pools.yaml").read_text()) if d]
    for doc in docs:
        if doc["kind"] == "PDDDeployment":
            spec = doc["spec"]
            spec["model"] = {  # no KV shape: the router reads it from the pulled config.json
                "servedName": "tiny-qwen3",
                "source": {"huggingFace": {"repo": "acme/tiny-qwen3", "endpoint": hub.url,
                                           "tokenSecret": {"name": "hf"}}},
            }  # fmt: skip
            for pool in filter(None, (spec.get("poolA"), spec.get("poolB"))):
                pool.pop("resources", None)
    by_cluster = render_file(yaml.safe_dump_all(docs), token="model-pull-test")
    return [ClusterObjects(str(c), objs) for c, objs in by_cluster.items()]


def start(hub: FakeHub, token: str, log_dir: Path) -> Any:
    plans = plan_pods(rendered(hub), secrets={"hf": {"token": token}},
                      addressing=HostAddressing())  # fmt: skip
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(log_dir / "hf")}
    return start_host_pods(plans, log_dir, link=LINK, env=env)


def test_init_containers_pull_the_repo_and_the_stack_serves_it(hub: FakeHub, tmp_path) -> None:
    running = start(hub, "s3cret", tmp_path)
    try:
        (router,) = running.of_role("router")
        body = {"model": "tiny-qwen3", "prompt": "The quick brown fox", "max_tokens": 4,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        response = httpx.post(f"{router.http_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
    finally:
        running.stop()
    pulled = [p for p in (tmp_path / "volumes").rglob("model.safetensors")]
    workers = [p for p in pulled if "-router-" not in str(p)]
    assert len(workers) == len(running.pods) - len(running.of_role("router")) - len(
        running.of_role("redis")
    )  # every worker pod pulled into its own emptyDir
    assert not [p for p in pulled if "-router-" in str(p)]  # the router: tokenizer only
    prefill_log = next(tmp_path.glob("*-prefill-0.log")).read_text()
    assert "model acme/tiny-qwen3: pulled into" in prefill_log
    resolves = [r for r in hub.requests if "/resolve/" in r and r.startswith("GET")]
    assert any(r.endswith("model.safetensors") for r in resolves)


def test_a_refused_token_stops_the_start_with_the_reason(hub: FakeHub, tmp_path) -> None:
    with pytest.raises(HostPodsStartError, match=r"model-pull exited 1: TokenRejected: "):
        start(hub, "wrong", tmp_path)
    assert os.path.exists(tmp_path)
