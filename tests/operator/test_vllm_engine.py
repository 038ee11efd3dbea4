"""A role's ``engineType: vllm``: the vLLM worker image and vLLM's flags in its pod, and the
combinations the operator refuses (the InvalidSpec condition's reasons)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pdd.common.block_hash import DEFAULT_BLOCK_SIZE
from pdd.operator.builders.deployments import build_router_deployment, build_worker_deployment
from pdd.operator.builders.meta import Site
from pdd.operator.naming import Component, Owner
from pdd.operator.plan import build_plan
from pdd.operator.spec import PDDSpec
from pdd.operator.validation import InvalidSpecError, parse_spec
from pdd.router.config import RouterConfig

pytestmark = pytest.mark.unit

VLLM_IMAGE = "ghcr.io/example/pdd-worker-vllm:0.1.0"
VLLM_SETTINGS = {
    "gpuMemoryUtilization": 0.85,
    "maxNumSeqs": 256,
    "maxModelLen": 8192,
    "maxNumBatchedTokens": 4096,
    "tensorParallelSize": 1,
    "kvCacheDtype": "fp8",
    "enforceEager": True,
}


def vllm_cr(cr: dict[str, Any], **main: Any) -> dict[str, Any]:
    """``cr`` with MD on vLLM (``main`` over the role's section), the vLLM image named, and
    the one dtype P and RLD (pdd engine) and MD (vLLM) need to exchange KV."""
    cr = copy.deepcopy(cr)
    cr["spec"]["images"]["vllmWorker"] = VLLM_IMAGE
    cr["spec"]["engine"] = {**cr["spec"].get("engine", {}), "dtype": "bfloat16"}
    cr["spec"]["mainDecode"] = {**cr["spec"]["mainDecode"], "engineType": "vllm", **main}
    return cr


def container(spec: PDDSpec, owner: Owner, role: Component) -> dict[str, Any]:
    deployment = build_worker_deployment(spec, owner, role, Site("serving"), "hash")
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def test_a_vllm_role_runs_the_vllm_image_with_vllms_flags(
    pool_b_cr: dict[str, Any], owner: Owner
) -> None:
    spec = parse_spec(vllm_cr(pool_b_cr, vllm=VLLM_SETTINGS)["spec"], "qwen")
    md = container(spec, owner, Component.MAIN)
    assert md["image"] == VLLM_IMAGE
    assert md["args"][5:] == [
        "--engine", "vllm", "--router-block-size", str(DEFAULT_BLOCK_SIZE),
        "--gpu-memory-utilization", "0.85", "--max-num-seqs", "256", "--max-model-len", "8192",
        "--max-num-batched-tokens", "4096", "--tensor-parallel-size", "1",
        "--kv-cache-dtype", "fp8", "--enforce-eager",
    ]  # fmt: skip
    for role in (Component.PREFILL, Component.RELAY):  # engineType pdd, the default
        pdd = container(spec, owner, role)
        assert pdd["image"] == spec.images.worker
        assert pdd["args"] == ["worker", "--role", str(role), "--config", "/etc/pdd/config.json"]


def test_the_vllm_workers_router_block_size_is_the_routers(
    pool_b_cr: dict[str, Any], owner: Owner
) -> None:
    """The router the operator deploys takes no block size: its default is the deployment's,
    and each vLLM worker is told that one (it renames vLLM's blocks into the router's)."""
    spec = parse_spec(vllm_cr(pool_b_cr)["spec"], "qwen")
    router = build_router_deployment(spec, owner, "hash")["spec"]["template"]["spec"]
    assert not [a for a in router["containers"][0]["args"] if a.startswith("--block-size")]
    routers = RouterConfig.model_fields["block_size"].default
    args = container(spec, owner, Component.MAIN)["args"]
    assert args[args.index("--router-block-size") + 1] == str(routers)
    assert args[5:] == ["--engine", "vllm", "--router-block-size", str(DEFAULT_BLOCK_SIZE)]


def test_every_object_of_a_vllm_deployment_is_valid_for_kubernetes(
    pool_b_cr: dict[str, Any], owner: Owner
) -> None:
    cr = vllm_cr(pool_b_cr, vllm=VLLM_SETTINGS)
    cr["spec"]["prefill"] = {"engineType": "vllm", "vllm": {"maxNumSeqs": 8}}
    spec = parse_spec(cr["spec"], "qwen")
    version = kubernetes_validate.latest_version()
    for _, obj in build_plan(spec, owner, "token").children:
        kubernetes_validate.validate(obj, version, strict=True)


#: (change to MD's section of a valid spec, spec-level change, text of the problem)
REFUSED = [
    (
        {"engineType": "vllm"},
        {"images": None},
        "mainDecode.engineType is vllm but images.vllmWorker",
    ),
    ({"vllm": {"maxNumSeqs": 8}}, {}, "mainDecode: vllm settings are set but engineType is pdd"),
    (
        {"engineType": "vllm", "engine": {"maxPromptTokens": 4096}},
        {},
        "mainDecode: maxPromptTokens is the pdd engine's setting and vLLM has none",
    ),
    (
        {"engineType": "vllm"},
        {"engine": {"maxPromptTokens": 4096}},
        "mainDecode: maxPromptTokens is the pdd engine's setting",
    ),
    (
        {"engineType": "vllm", "vllm": {"tensorParallelSize": 2}},
        {},
        "mainDecode: vllm.tensorParallelSize (2) needs that many GPUs in each pod, and its "
        "resources give 1",
    ),
    (
        {"engineType": "vllm"},
        {},
        "prefill, relay and mainDecode run on different engines (engineType: pdd, pdd, vllm) "
        "and so need one dtype, not auto: set engine.dtype (dtype: auto, auto, auto)",
    ),
    (
        {"engineType": "vllm", "engine": {"dtype": "float32"}},
        {"engine": {"dtype": "bfloat16"}},
        "(dtype: bfloat16, bfloat16, float32)",
    ),
]


@pytest.mark.parametrize(("main", "change", "text"), REFUSED)
def test_bad_vllm_combinations_are_refused_with_the_fix(
    pool_b_cr: dict[str, Any], main: dict[str, Any], change: dict[str, Any], text: str
) -> None:
    cr = copy.deepcopy(pool_b_cr)
    cr["spec"]["images"]["vllmWorker"] = VLLM_IMAGE
    cr["spec"]["mainDecode"] = {**cr["spec"]["mainDecode"], **main}
    for key, value in change.items():
        if key == "images":
            cr["spec"]["images"].pop("vllmWorker")
        else:
            cr["spec"][key] = value
    with pytest.raises(InvalidSpecError) as caught:
        parse_spec(cr["spec"], "qwen")
    assert any(text in problem for problem in caught.value.problems), caught.value.problems


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_mixed_deployment_of_one_dtype_is_admitted(pool_b_cr: dict[str, Any], dtype: str) -> None:
    """P and RLD on the pdd engine, MD on vLLM: they exchange the same KV chunks once they
    compute in one dtype (docs/vllm.md); each role may name it in its own engine."""
    cr = vllm_cr(pool_b_cr)
    cr["spec"]["engine"] = {"dtype": dtype}
    assert parse_spec(cr["spec"], "qwen").main_decode.engine_type == "vllm"
    cr["spec"]["engine"] = {"dtype": "auto"}
    for role in ("prefill", "relay", "mainDecode"):
        cr["spec"][role]["engine"] = {"dtype": dtype}
    assert parse_spec(cr["spec"], "qwen").main_decode.engine_type == "vllm"


def test_tensor_parallel_within_the_pods_gpus_is_admitted(pool_b_cr: dict[str, Any]) -> None:
    cr = vllm_cr(pool_b_cr, vllm={"tensorParallelSize": 2})
    cr["spec"]["poolB"]["resources"]["limits"]["nvidia.com/gpu"] = 2
    assert parse_spec(cr["spec"], "qwen").main_decode.vllm.tensor_parallel_size == 2


def test_the_gpu_pool_examples_vllm_variant_runs_every_role_on_vllm(owner: Owner) -> None:
    text = (Path(__file__).resolve().parents[2] / "examples" / "node-pools-vllm.yaml").read_text()
    cr = yaml.safe_load(text)
    spec = parse_spec(cr["spec"], cr["metadata"]["name"])
    for role in (Component.PREFILL, Component.RELAY, Component.MAIN):
        pod = container(spec, owner, role)
        assert pod["image"] == spec.images.vllm_worker
        assert pod["args"][5:9] == ["--engine", "vllm", "--router-block-size", "16"]
        assert "--gpu-memory-utilization" in pod["args"]
        assert pod["resources"]["limits"]["nvidia.com/gpu"] == 1
