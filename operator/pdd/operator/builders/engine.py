"""A worker role's engine in its pod: the image and the ``pdd worker`` flags.

A role's ``engineType`` picks the engine. ``pdd`` (the default) runs the worker image with
its engine settings from the config document. ``vllm`` runs the vLLM worker image with
``--engine vllm``, the role's ``vllm`` settings as vLLM's own flag names (flags win over
the config document's engine settings), and ``--router-block-size``: the vLLM worker
renames vLLM's cached blocks into the router's blocks, so it must know the router's
size, which in a deployment is the router's default (the operator sets no other).
"""

from __future__ import annotations

from pdd.common.block_hash import DEFAULT_BLOCK_SIZE
from pdd.operator.spec import PDDSpec, VllmSettings, WorkerRole

#: ``VllmSettings`` fields -> ``pdd worker`` flags (vLLM's names; the worker's
#: pdd.worker.vllm.worker_config and its engine settings' aliases take them).
VLLM_FLAGS = {
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "max_num_seqs": "--max-num-seqs",
    "max_model_len": "--max-model-len",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "tensor_parallel_size": "--tensor-parallel-size",
    "kv_cache_dtype": "--kv-cache-dtype",
}
#: Boolean settings: the flag alone when true.
VLLM_SWITCHES = {"enforce_eager": "--enforce-eager"}


def worker_image(spec: PDDSpec, role: WorkerRole) -> str:
    """The role's image: the vLLM worker image for ``engineType: vllm`` (validation makes
    sure it is set), else the worker image."""
    if role.engine_type == "vllm" and spec.images.vllm_worker is not None:
        return spec.images.vllm_worker
    return spec.images.worker


def engine_args(role: WorkerRole) -> list[str]:
    """The ``pdd worker`` flags that choose the role's engine; none for the pdd engine."""
    if role.engine_type != "vllm":
        return []
    args = ["--engine", "vllm", "--router-block-size", str(DEFAULT_BLOCK_SIZE)]
    return args + vllm_flags(role.vllm or VllmSettings())


def vllm_flags(settings: VllmSettings) -> list[str]:
    """vLLM's settings that are set, as its flags (``--max-num-seqs 256``)."""
    args: list[str] = []
    for field, value in settings.model_dump(exclude_none=True).items():
        if field in VLLM_SWITCHES:
            args += [VLLM_SWITCHES[field]] if value else []
        else:
            args += [VLLM_FLAGS[field], str(value)]
    return args
