"""What the operator renders for a vLLM role, read by the real ``pdd worker`` parser: its
flags and the config document it mounts reach vLLM's settings by vLLM's names (no vLLM
needed: the settings are checked before vLLM starts)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdd.operator.builders.config import build_worker_config
from pdd.operator.builders.deployments import build_worker_deployment
from pdd.operator.builders.meta import Site
from pdd.operator.naming import Component, Owner
from pdd.operator.validation import parse_spec
from pdd.worker.server import parse_args

pytestmark = pytest.mark.unit

CR = Path(__file__).resolve().parents[2] / "operator" / "data" / "pool-b.yaml"
OWNER = Owner(name="qwen", namespace="serving", uid="0b9e7c1e-0000-4000-8000-000000000001")


def rendered_md_args(tmp_path: Path, main: dict[str, Any], engine: dict[str, Any]) -> list[str]:
    """MD's container args as the operator renders them, its config file written to tmp."""
    cr = copy.deepcopy(yaml.safe_load(CR.read_text()))
    cr["spec"]["images"]["vllmWorker"] = "vllm-worker:test"
    cr["spec"]["mainDecode"] = {"replicas": 1, "engineType": "vllm", **main}
    cr["spec"]["engine"] = engine
    spec = parse_spec(cr["spec"], "qwen")
    site = Site("serving")
    config = tmp_path / "config.json"
    config.write_text(build_worker_config(spec, OWNER, site).to_json())
    deployment = build_worker_deployment(spec, OWNER, Component.MAIN, site, "hash")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "worker"
    return [str(config) if a == "/etc/pdd/config.json" else a for a in args[1:]]


def test_the_rendered_vllm_flags_reach_the_workers_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDD_INSTANCE_ID", "qwen-main-0")
    vllm = {
        "gpuMemoryUtilization": 0.85, "maxNumSeqs": 256, "maxModelLen": 8192,
        "maxNumBatchedTokens": 4096, "tensorParallelSize": 1, "kvCacheDtype": "fp8",
        "enforceEager": True,
    }  # fmt: skip
    # The shared engine settings size the KV in GiB and cap requests: vLLM's names win.
    engine = {"kvCacheGiB": 20, "maxRunningRequests": 64, "dtype": "bfloat16"}
    args = parse_args(rendered_md_args(tmp_path, {"vllm": vllm}, engine))
    assert args.engine == "vllm" and args.role == "main"
    assert args.router_block_size == 16
    assert args.kv_cache_memory_fraction == 0.85 and args.kv_cache_gib is None
    assert (args.max_running_requests, args.max_model_len, args.max_num_batched_tokens) == (
        256, 8192, 4096,
    )  # fmt: skip
    assert (args.tensor_parallel_size, args.kv_cache_dtype, args.enforce_eager) == (1, "fp8", True)
    assert args.dtype == "bfloat16"  # from the config document


def test_unset_vllm_settings_leave_the_config_documents_engine_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDD_INSTANCE_ID", "qwen-main-0")
    args = parse_args(rendered_md_args(tmp_path, {}, {"kvCacheGiB": 20, "dtype": "float32"}))
    assert args.engine == "vllm" and args.kv_cache_gib == 20
    assert (args.tensor_parallel_size, args.kv_cache_dtype) == (1, "auto")
    assert not args.enforce_eager
