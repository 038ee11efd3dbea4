"""vLLM's engine arguments for a PDD instance: one builder, so every vLLM that PDD starts
(``pdd generate --engine vllm``, the slow tests, the vLLM worker next) loads the same
connector the same way.

Settings carry vLLM's own names (``max_num_seqs``, ``max_model_len``,
``max_num_batched_tokens``, ``gpu_memory_utilization``, ``kv_cache_memory_bytes``,
``tensor_parallel_size``, ``kv_cache_dtype``, ``block_size``, ``enforce_eager``), as
its flags spell them with dashes, so a vLLM user reads PDD's configuration as vLLM's.
``None`` leaves vLLM's default. No vLLM import: the arguments are plain data, checked
here without vLLM, and vLLM's ``LLM(**engine_kwargs(...))`` turns the
``kv_transfer_config`` dict into its ``KVTransferConfig`` (``EngineArgs``, for
``AsyncLLM``, takes ``KVTransferConfig(**kwargs["kv_transfer_config"])``; the same for
``kv_events_config`` and ``KVEventsConfig``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

#: The class and module vLLM loads the PDD connector from (``pdd.worker.vllm.connector``).
CONNECTOR_CLASS = "PDDConnector"
CONNECTOR_MODULE = "pdd.worker.vllm.connector"
#: The logits processor that carries a resumed request's penalties over its earlier output
#: (``pdd.worker.vllm.prior_penalties``), in vLLM's ``module:class`` form; it touches only
#: requests whose ``extra_args`` name it (``sampling.PRIOR_PENALTIES_KEY``).
PRIOR_PENALTIES_PROCESSOR = "pdd.worker.vllm.prior_penalties:PriorOutputPenalties"

#: vLLM's ``kv_role``: the PDD connector exports and imports alike, so ``kv_both`` serves
#: P (export), MD (import) and a relay (both); the narrower roles change vLLM's own
#: scheduling (a consumer defers freeing blocks), not the connector.
KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]

#: Engine arguments a PDD instance passes only when set (``None``: vLLM's default).
_OPTIONAL = (
    "block_size",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "seed",
)


@dataclass(frozen=True)
class VllmEngineSettings:
    """What a PDD instance asks of vLLM, by vLLM's names.

    ``kv_store_dir`` turns the PDD connector on: the folder where instances exchange KV
    chunks (``store.DirectoryKVStore``); None runs vLLM without a connector.
    """

    model: str
    dtype: str = "auto"
    block_size: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    tensor_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    seed: int | None = None
    kv_store_dir: str | Path | None = None
    kv_role: KVRole = "kv_both"
    #: Where vLLM publishes its KV events (zmq PUB; an ``ipc://`` path or ``tcp://*:PORT``
    #: binds), so the worker renames them into the router's cache events; None: no events.
    kv_events_endpoint: str | None = None
    kv_events_topic: str = "pdd-kv"


def engine_kwargs(settings: VllmEngineSettings) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` (and ``vllm.EngineArgs``) from ``settings``."""
    kwargs: dict[str, Any] = {
        "model": settings.model,
        "dtype": settings.dtype,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "kv_cache_dtype": settings.kv_cache_dtype,
        "enforce_eager": settings.enforce_eager,
        "enable_prefix_caching": settings.enable_prefix_caching,
        "logits_processors": [PRIOR_PENALTIES_PROCESSOR],
    }
    for name in _OPTIONAL:
        value = getattr(settings, name)
        if value is not None:
            kwargs[name] = value
    if settings.kv_store_dir is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config(settings.kv_store_dir, settings.kv_role)
    if settings.kv_events_endpoint is not None:
        kwargs["kv_events_config"] = kv_events_config(
            settings.kv_events_endpoint, settings.kv_events_topic
        )
    return kwargs


def kv_events_config(endpoint: str, topic: str) -> dict[str, Any]:
    """vLLM's ``KVEventsConfig`` fields: every block its prefix cache stores or evicts,
    published as msgpack ``KVEventBatch``es on a zmq PUB socket bound at ``endpoint``."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "topic": topic,
    }


def kv_transfer_config(store_dir: str | Path, kv_role: KVRole = "kv_both") -> dict[str, Any]:
    """vLLM's ``KVTransferConfig`` fields that load the PDD connector over ``store_dir``."""
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": kv_role,
        "kv_connector_extra_config": {"store_dir": str(store_dir)},
    }
