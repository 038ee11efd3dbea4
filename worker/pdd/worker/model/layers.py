"""Building blocks of a Llama-family decoder layer, reading K/V from the paged cache.

Projections are fused (q/k/v in one matmul, gate/up in one) because on small models
and on the CPU the number of kernel launches, not FLOPs, dominates a decode step; the
loader concatenates the checkpoint's separate tensors into them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdd.worker.batch import ForwardBatch
from pdd.worker.kv_cache import PagedKVCache
from pdd.worker.model.config import ModelConfig
from pdd.worker.model.rope import apply_rotary


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as transformers does, so bf16 matches it."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention over the new tokens plus the cached prefix.

    Writes the new tokens' K/V to their cache slots first, then attends: a fresh
    prefill attends over the new K/V directly; anything with a cached prefix gathers
    its blocks through the block table. Queries are padded per sequence only here.
    """

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(config.hidden_size, sum(self.split), bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv: PagedKVCache,
        rope: tuple[torch.Tensor, torch.Tensor],
        attn_bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention output [T, hidden]; ``attn_bias`` is the batch mask made additive."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        kv.write(self.layer_idx, batch.slot_mapping, k, v)
        if batch.prefill_only:
            keys, values = _pad(k, batch), _pad(v, batch)
        else:
            keys, values = kv.gather(self.layer_idx, batch.block_tables)
        out = F.scaled_dot_product_attention(
            _pad(q, batch).transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=attn_bias,
            is_causal=attn_bias is None,
            scale=self.head_dim**-0.5,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return self.o_proj(_unpad(out.transpose(1, 2), batch))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = nn.Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv: PagedKVCache,
        rope: tuple[torch.Tensor, torch.Tensor],
        attn_bias: torch.Tensor | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, kv, rope, attn_bias)
        return x + self.mlp(self.post_attention_layernorm(x))


def additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Boolean mask (True = visible) as 0 / -inf in the compute dtype.

    SDPA would convert a boolean mask on every call; converting once per forward
    instead of once per layer saves two full-mask passes per layer.
    """
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf")
    )


def _pad(x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """Flat [T, H, D] -> [B, max_q, H, D] (a view when every sequence has max_q tokens)."""
    shape = (batch.batch_size, batch.max_q, x.shape[1], x.shape[2])
    if batch.query_index is None:
        return x.view(shape)
    padded = x.new_zeros((shape[0] * shape[1], shape[2], shape[3]))
    return padded.index_copy_(0, batch.query_index, x).view(shape)


def _unpad(y: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """[B, max_q, H, D] -> flat [T, H * D], dropping padding queries."""
    flat = y.reshape(batch.batch_size * batch.max_q, -1)
    return flat if batch.query_index is None else flat.index_select(0, batch.query_index)
