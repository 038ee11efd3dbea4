"""GPU types, the served model, and the step-time model of one continuous-batching step.

A chip is described by the technique's four axes (peak compute, memory capacity,
memory bandwidth, interconnect) plus a price. One engine step on an instance
(``gpus`` chips, tensor-parallel) costs

    overhead + max(compute, memory) + tensor-parallel all-reduce

* compute = (2 x active params x new tokens + attention FLOPs) / (peak x mfu):
  what bounds a prefill;
* memory = (weights + KV read) / (bandwidth x mbu): what bounds a decode step;
* an extend (MD recomputing relayed tokens) is a step with a few hundred new tokens
  on a long context, so it falls between the two by the same formula.

``mfu``, ``mbu`` and ``overhead_s`` are the calibration knobs
(:mod:`pdd.simulator.calibration` fits them from the worker's own benchmark).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

_TERA = 1e12
_GIGA = 1e9
#: Bytes per activation element in the tensor-parallel all-reduce (bf16).
_ACTIVATION_BYTES = 2


class HardwareError(ValueError):
    """A model that does not fit its instance, or a non-physical parameter."""


@dataclass(frozen=True)
class Efficiency:
    """How close an engine gets to the chip's peaks; fitted by calibration."""

    mfu: float = 0.5  # achieved / peak FLOP/s on large matmuls
    mbu: float = 0.8  # achieved / peak memory bandwidth when streaming weights and KV
    overhead_s: float = 0.002  # fixed cost per step (launches, scheduling, sampling)

    def __post_init__(self) -> None:
        if not (0 < self.mfu <= 1 and 0 < self.mbu <= 1):
            raise HardwareError(f"mfu and mbu must be in (0, 1], got {self.mfu}, {self.mbu}")
        if self.overhead_s < 0:
            raise HardwareError(f"overhead_s must be >= 0, got {self.overhead_s}")


@dataclass(frozen=True)
class GpuType:
    """One chip along the four axes, and what it costs per hour."""

    name: str
    peak_tflops: float  # dense, in the model's compute dtype
    memory_gb: float
    memory_bandwidth_tbps: float  # TB/s
    interconnect_gbps: float  # GB/s between chips of one instance (NVLink-class)
    price_per_hour: float
    efficiency: Efficiency = field(default_factory=Efficiency)

    def __post_init__(self) -> None:
        for axis in ("peak_tflops", "memory_gb", "memory_bandwidth_tbps", "interconnect_gbps"):
            if getattr(self, axis) <= 0:
                raise HardwareError(f"GPU {self.name}: {axis} must be positive")
        if self.price_per_hour < 0:
            raise HardwareError(f"GPU {self.name}: price_per_hour must be >= 0")


@dataclass(frozen=True)
class ModelSpec:
    """What the step model needs to know about the served LLM."""

    name: str
    active_params_b: float  # billions of parameters touched per token (MoE: the active ones)
    weight_gb: float  # resident weight bytes of the whole model, GB
    kv_bytes_per_token: int
    attention_flops_per_pair: float  # FLOPs per (query token, context token): 4 x layers x d_attn
    num_layers: int
    hidden_size: int

    def __post_init__(self) -> None:
        for name in ("active_params_b", "weight_gb", "kv_bytes_per_token", "num_layers"):
            if getattr(self, name) <= 0:
                raise HardwareError(f"model {self.name}: {name} must be positive")
        if self.attention_flops_per_pair < 0 or self.hidden_size <= 0:
            raise HardwareError(f"model {self.name}: attention FLOPs and hidden size are invalid")


#: Share of an instance's memory the engine may use (the rest: activations, fragmentation).
MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class InstanceShape:
    """``gpus`` chips of one type serving one model replica (tensor parallel)."""

    gpu: GpuType
    gpus: int
    model: ModelSpec

    def __post_init__(self) -> None:
        if self.gpus <= 0:
            raise HardwareError(f"gpus per instance must be positive, got {self.gpus}")
        if self.kv_capacity_tokens <= 0:
            raise HardwareError(
                f"model {self.model.name} ({self.model.weight_gb:g} GB) leaves no room for KV "
                f"on {self.gpus} x {self.gpu.name} ({self.gpu.memory_gb:g} GB each); "
                "use more GPUs per instance"
            )

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV that fit beside the weights: the batch's memory budget."""
        free = self.gpus * self.gpu.memory_gb * MEMORY_UTILIZATION - self.model.weight_gb
        return int(free * _GIGA / self.model.kv_bytes_per_token)

    @property
    def price_per_hour(self) -> float:
        return self.gpus * self.gpu.price_per_hour

    def step_seconds(
        self, new_tokens: float, kv_read_tokens: float, attention_pairs: float
    ) -> float:
        """Seconds of one engine step that computes ``new_tokens`` tokens, reads
        ``kv_read_tokens`` tokens of cached KV and scores ``attention_pairs``
        (query, key) pairs."""
        per_token, per_pair, compute_rate, weights, kv_bytes, memory_rate, overhead = (
            self._step_terms
        )
        flops = per_token * new_tokens
        flops += per_pair * attention_pairs
        compute = flops / compute_rate
        read = weights + kv_read_tokens * kv_bytes
        memory = read / memory_rate
        return overhead + max(compute, memory) + self._all_reduce_seconds(new_tokens)

    @functools.cached_property
    def _step_terms(self) -> tuple[float, float, float, float, float, float, float]:
        """The constants of :meth:`step_seconds`, computed once: it runs at every engine
        step of a simulation. Each is the same expression (same operation order) the step
        formula had inline, so the times are unchanged to the last bit."""
        m, g, eff = self.model, self.gpu, self.gpu.efficiency
        return (
            2.0 * m.active_params_b * _GIGA,
            m.attention_flops_per_pair,
            self.gpus * g.peak_tflops * _TERA * eff.mfu,
            m.weight_gb * _GIGA,
            m.kv_bytes_per_token,
            self.gpus * g.memory_bandwidth_tbps * _TERA * eff.mbu,
            eff.overhead_s,
        )

    def _all_reduce_seconds(self, new_tokens: float) -> float:
        """Two ring all-reduces of the activations per layer (attention and MLP)."""
        if self.gpus == 1:
            return 0.0
        m = self.model
        payload = 2 * m.num_layers * new_tokens * m.hidden_size * _ACTIVATION_BYTES
        ring = 2 * (self.gpus - 1) / self.gpus
        return payload * ring / (self.gpu.interconnect_gbps * _GIGA)

    def prefill_seconds(self, new_tokens: float, cached_tokens: float) -> float:
        """One step over ``new_tokens`` after ``cached_tokens`` of reused prefix."""
        pairs = new_tokens * cached_tokens + new_tokens * new_tokens / 2
        return self.step_seconds(new_tokens, cached_tokens + new_tokens, pairs)

    def decode_seconds(self, batch: int, context_tokens: float) -> float:
        """One decode step: ``batch`` sequences holding ``context_tokens`` tokens in all."""
        return self.step_seconds(batch, context_tokens, context_tokens)

    def prefill_tokens_per_s(
        self, max_num_batched_tokens: int, cached_tokens: float = 0.0
    ) -> float:
        """Steady prefill throughput with full chunks: what the router's policy assumes."""
        return max_num_batched_tokens / self.prefill_seconds(max_num_batched_tokens, cached_tokens)
