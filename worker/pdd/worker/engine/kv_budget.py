"""How many KV blocks an engine gets: its budget in bytes (``EngineConfig``: a size, a
fraction of the device's free memory, or the device's default), in blocks of its layout.

A budget this device cannot hold, or one below a block, is a setting to change
(``EngineConfigError``), not an out-of-memory crash. Called once the weights are in.
"""

from __future__ import annotations

import torch

from pdd.worker.engine.config import (
    DEFAULT_CPU_KV_BYTES,
    DEFAULT_CUDA_KV_FRACTION,
    EngineConfig,
    EngineConfigError,
)
from pdd.worker.engine.device import DeviceProbe, kv_budget_bytes
from pdd.worker.model.kv_cache import KVLayout, PagedKVCache

GIB = 2**30


def blocks_for_budget(
    config: EngineConfig, layout: KVLayout, device: torch.device, probe: DeviceProbe
) -> int:
    """KV blocks for the budget."""
    budget = kv_budget(config, device, probe)
    if config.kv_cache_memory_fraction is None:
        free = probe.free_memory_bytes(device)
        if budget > free:
            raise EngineConfigError(
                f"a KV cache of {budget / GIB:.2f} GiB was asked for, but {device} has "
                f"{free / GIB:.2f} GiB free after the weights; lower kvCacheGiB (or "
                "--kv-cache-gib), or give kvCacheMemoryFraction instead"
            )
    try:
        return PagedKVCache.blocks_for_budget(layout, budget)
    except ValueError as exc:
        raise EngineConfigError(str(exc)) from None


def kv_budget(config: EngineConfig, device: torch.device, probe: DeviceProbe) -> int:
    """Bytes for the KV pool (see ``EngineConfig``)."""
    fraction = config.kv_cache_memory_fraction
    if fraction is None and config.kv_budget_bytes is not None:
        return config.kv_budget_bytes
    if fraction is None and device.type == "cpu":
        return DEFAULT_CPU_KV_BYTES
    return kv_budget_bytes(fraction or DEFAULT_CUDA_KV_FRACTION, device, probe)
