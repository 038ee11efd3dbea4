"""The engine's options and its stats snapshot (plain data, no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from pdd.common.block_hash import DEFAULT_BLOCK_SIZE

#: The KV cache when nothing sizes it: most of a GPU's free memory (vLLM's 0.9 default)...
DEFAULT_CUDA_KV_FRACTION = 0.9
#: ... but a modest fixed size on the CPU, whose memory the host and other processes share.
DEFAULT_CPU_KV_BYTES = 256 * 2**20


class EngineConfigError(ValueError):
    """An engine option is out of range; the message names it."""


@dataclass(frozen=True)
class EngineConfig:
    """Engine options. The KV pool is ``num_blocks`` blocks, else what fits in
    ``kv_cache_memory_fraction`` of the device memory free after the weights loaded, else
    what fits ``kv_budget_bytes``, else the default for the device: ``DEFAULT_CUDA_KV_FRACTION``
    of free memory on CUDA, ``DEFAULT_CPU_KV_BYTES`` on the CPU (which the host shares).
    See ``device`` for ``auto`` devices and dtypes."""

    dtype: str | None = None  # None or "auto": bfloat16 on CUDA, the checkpoint's own on CPU
    device: str = "cpu"  # "auto": CUDA when one is visible
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None
    kv_budget_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None
    max_num_batched_tokens: int = 512  # per-step token budget; prefills beyond it are chunked
    max_running_requests: int = 64  # capped at max_num_batched_tokens: each running one decodes
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_prompt_tokens: int | None = None  # None: the context window less one token

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_batched_tokens", "max_running_requests"):
            if getattr(self, name) < 1:
                raise EngineConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_blocks", "kv_budget_bytes", "max_model_len", "max_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise EngineConfigError(f"{name} must be >= 1 (or None), got {value}")
        fraction = self.kv_cache_memory_fraction
        if fraction is not None and not 0 < fraction <= 1:
            raise EngineConfigError(f"kv_cache_memory_fraction must be in (0, 1], got {fraction}")


@dataclass(frozen=True)
class EngineStats:
    num_total_blocks: int
    num_free_blocks: int
    num_cached_blocks: int  # held by the prefix cache (evictable + protected)
    num_locked_blocks: int  # cached blocks pinned by a prefix lock (a live request or handshake)
    num_running: int
    num_waiting: int
    num_awaiting_kv: int
    num_preemptions: int  # since start
