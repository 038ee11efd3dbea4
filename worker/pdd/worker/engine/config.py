"""The engine's options and its stats snapshot (plain data, no torch)."""

from __future__ import annotations

from dataclasses import dataclass


class EngineConfigError(ValueError):
    """An engine option is out of range; the message names it."""


@dataclass(frozen=True)
class EngineConfig:
    """Engine options. The KV pool is ``num_blocks`` blocks, else what fits ``kv_budget_bytes``."""

    dtype: str | None = None  # None: the checkpoint's own
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int | None = None
    kv_budget_bytes: int = 256 * 2**20
    max_num_batched_tokens: int = 512  # per-step token budget; prefills beyond it are chunked
    max_running: int = 64  # capped at max_num_batched_tokens: every running request decodes
    max_model_len: int | None = None  # None: the model's max_position_embeddings

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_batched_tokens", "max_running", "kv_budget_bytes"):
            if getattr(self, name) < 1:
                raise EngineConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise EngineConfigError(f"{name} must be >= 1 (or None), got {value}")


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
