"""``pdd worker --engine vllm``: the worker's flags as vLLM's engine settings.

The worker's engine flags already carry vLLM's names where the pdd engine has the same
setting (``--max-num-seqs``, ``--gpu-memory-utilization``, ``--max-model-len``,
``--max-num-batched-tokens``, ``--block-size``, ``--dtype``); the settings only vLLM has
are ``pdd.worker.options.VllmOnlySettings``, under its names (``--tensor-parallel-size``,
``--kv-cache-dtype``, ``--enforce-eager``). A flag vLLM has no use for is
refused with the reason (``VllmWorkerConfigError``; the worker exits 2), never ignored.
No vLLM import: the settings are checked before vLLM starts.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from pdd.common.model_store import ModelNotPulledError, resolve_model
from pdd.worker.options import WorkerOptions
from pdd.worker.vllm.engine_args import VllmEngineSettings

#: vLLM's KV space unless the flags size it: the pdd worker's CPU default.
DEFAULT_KV_BYTES = 256 << 20


class VllmWorkerConfigError(ValueError):
    """The worker's flags ask engine vllm for what it does not do; says which."""


def vllm_settings(options: WorkerOptions) -> VllmEngineSettings:
    """vLLM's settings from ``pdd worker``'s options (``VllmWorkerConfigError``)."""
    if options.router_block_size <= 0:
        raise VllmWorkerConfigError(
            f"--router-block-size must be positive, got {options.router_block_size}"
        )
    pdd_only = (("num_blocks", "--num-blocks"), ("max_prompt_tokens", "--max-prompt-tokens"))
    for dest, flag in pdd_only:
        if getattr(options, dest) is not None:
            raise VllmWorkerConfigError(f"{flag} is the pdd engine's; vLLM has no such setting")
    kv_bytes = None
    if options.kv_cache_gib is not None:
        kv_bytes = round(options.kv_cache_gib * 2**30)
    elif options.kv_cache_memory_fraction is None:
        kv_bytes = DEFAULT_KV_BYTES
    return VllmEngineSettings(
        model=checkpoint(options.model),
        dtype=options.dtype or "auto",
        block_size=options.block_size,
        max_model_len=options.max_model_len,
        max_num_seqs=options.max_running_requests,
        max_num_batched_tokens=options.max_num_batched_tokens,
        gpu_memory_utilization=options.kv_cache_memory_fraction,
        kv_cache_memory_bytes=kv_bytes,
        tensor_parallel_size=options.tensor_parallel_size,
        kv_cache_dtype=options.kv_cache_dtype,
        enforce_eager=options.enforce_eager,
        seed=0,
        kv_events_endpoint=kv_events_endpoint(),
        kv_store_dir=None if options.role == "mono" else kv_store_dir(),
    )


#: The host files a vLLM worker names by its process ID, in the temp folder.
KV_STORE_PREFIX = "pdd-vllm-kv-"
KV_EVENTS_PREFIX = "pdd-vllm-kv-events-"


def kv_store_dir() -> str:
    """Where this worker and its vLLM engine core exchange KV chunks (the connector's
    store): a folder of its own, named by the worker's process ID, removed when it stops."""
    return f"{tempfile.gettempdir()}/{KV_STORE_PREFIX}{os.getpid()}"


def kv_events_endpoint() -> str:
    """Where this worker's vLLM publishes its KV events: an ipc socket named by the
    worker's process ID, so instances on one host never collide on a port."""
    return f"ipc://{tempfile.gettempdir()}/{KV_EVENTS_PREFIX}{os.getpid()}"


def remove_dead_workers_files(folder: Path | None = None) -> list[Path]:
    """Remove the KV stores and KV-event sockets of workers no longer running (a SIGKILL,
    an OOM kill: no stop of theirs ran) from ``folder`` (the temp folder); what it removed.

    A worker's files carry its process ID, so one whose ID names no process is nobody's.
    An ID reused by another process keeps its files until that one ends: never a live
    worker's files removed."""
    removed = []
    for path in (folder or Path(tempfile.gettempdir())).glob(f"{KV_STORE_PREFIX}*"):
        pid = path.name.removeprefix(KV_EVENTS_PREFIX).removeprefix(KV_STORE_PREFIX)
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def checkpoint(source: str) -> str:
    """The checkpoint directory vLLM loads for ``--model``: a folder or a pulled name."""
    try:
        resolved = resolve_model(source)
    except ModelNotPulledError as exc:
        raise VllmWorkerConfigError(str(exc)) from None
    if not (Path(resolved) / "config.json").is_file():
        raise VllmWorkerConfigError(
            f"--engine vllm runs a checkpoint directory (config.json and safetensors); "
            f"{source!r} is not one"
        )
    return resolved
