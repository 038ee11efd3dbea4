"""Building blocks of a Llama-family decoder layer, reading K/V from the paged cache.

Projections are fused (q/k/v in one matmul, gate/up in one) because on small models
and on the CPU the number of kernel launches, not FLOPs, dominates a decode step; the
loader concatenates the checkpoint's separate tensors into them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdd.worker.model.batch import AttentionGroup, ForwardBatch
from pdd.worker.model.config import ModelConfig
from pdd.worker.model.cpu_kernels import CpuKernels
from pdd.worker.model.kv_cache import PagedKVCache
from pdd.worker.model.rope import apply_rotary


@dataclass(frozen=True)
class LayerInputs:
    """What every layer reads besides the hidden states, built once per forward.

    ``rope`` is the (cos, sin) of the batch positions; ``attn_biases`` holds each
    attention group's mask made additive (see ``additive_mask``); ``kernels`` are the
    compiled CPU kernels where the model runs on them (see ``cpu_kernels.py``).
    """

    batch: ForwardBatch
    kv: PagedKVCache
    rope: tuple[torch.Tensor, torch.Tensor]
    attn_biases: tuple[torch.Tensor | None, ...]
    kernels: CpuKernels | None = None


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as transformers does, so bf16 matches it."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, kernels: CpuKernels | None = None) -> torch.Tensor:
        if kernels is not None and self._fits(x):
            return kernels.rms_norm(x, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def add(
        self, x: torch.Tensor, residual: torch.Tensor, kernels: CpuKernels | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(residual + x), residual + x): a pre-norm block's residual add and
        its norm in one pass where the kernels run (``residual`` is then updated in place)."""
        if kernels is not None and self._fits(x) and residual.is_contiguous():
            return kernels.add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = residual + x
        return self.forward(residual), residual

    def _fits(self, x: torch.Tensor) -> bool:
        return x.is_contiguous() and x.dtype == self.weight.dtype


class Linear(nn.Linear):
    """``nn.Linear`` that runs from a oneDNN-prepacked copy of its weight once packed.

    On the CPU a bf16 ``F.linear`` reorders the whole weight into oneDNN's blocked
    layout on every call; for a decode step (one row per sequence) that reorder costs
    more than the product itself (measured 2.5x on a 1024 x 5632 projection, one row).
    ``pack`` does it once at load time; in bf16 the results are bitwise those of
    ``F.linear``. An fp32 ``F.linear`` is MKL's sgemm, which packs the weight into its
    own panels on every call: at the row counts of a batched decode step (8-256 rows)
    that costs more than the product, and oneDNN from a prepacked weight takes about
    two thirds of the CPU time (the 200M preset's projections, 32 rows: 223 ms against
    357 ms a step; ``docs/engine.md``). In fp32 the two differ by summation order only.
    The plain weight stays the parameter (state dict, transformers export); the CUDA
    path never packs.
    """

    packed: PackedWeight | None = None

    def pack(self, compute_dtype: torch.dtype) -> None:
        """Keep a oneDNN-blocked copy of the weight in ``compute_dtype`` (see
        ``pack_dtype``) and compute from it from now on."""
        self.packed = PackedWeight.of(self.weight, self.bias, compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return self.packed(x)


def pack_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a prepacked projection computes in, or None where packing does not pay.

    fp32 packs as fp32, and bf16 as bf16 where oneDNN has native bf16 kernels (see
    ``Linear``). Where it has none (an AVX2-only x86 CPU: no AVX512-BF16, no AMX), a
    bf16 ``F.linear`` widens every product in software at a cost that grows with the
    rows: on such a CPU the 200M preset's four projections took 0.8 ms for one row
    but 42 ms for 32 and 570 ms for 512, against 1.0, 6.2 and 132 ms from an fp32
    packed copy (``docs/engine.md``). So a bf16 model packs its weights widened to fp32
    there: memory as an fp32 model's weights, KV still bf16, and outputs rounded to
    bf16 as ``F.linear``'s are (both sum in fp32; they differ by summation order only).
    """
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if dtype == torch.float32:
        return torch.float32
    if dtype != torch.bfloat16:
        return None
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return torch.bfloat16 if native else torch.float32


#: Rows from which a bf16 projection runs widened (``pack_dtype``): at one row the plain
#: bf16 product reads half the bytes and was faster (4.1 against 5.3 ms for the 200M
#: preset's projections and LM head on an AVX2-only CPU); from two rows on the widened
#: one was (6.4 against 9.1 ms at two, 12.2 against 29.7 at eight).
WIDENED_MIN_ROWS = 2


@dataclass(frozen=True)
class PackedWeight:
    """A [out, in] weight reordered once into oneDNN's layout (an opaque mkldnn tensor)
    in the dtype it computes in; calling it is ``F.linear(x, weight, bias)`` with the
    result in ``x``'s dtype. Packed widened (bf16 weights, fp32 packed), a single row
    still runs from the plain weight (``WIDENED_MIN_ROWS``)."""

    packed: torch.Tensor
    bias: torch.Tensor | None
    compute_dtype: torch.dtype
    plain: tuple[torch.Tensor, torch.Tensor | None]  # the weight and bias, not copied

    @classmethod
    def of(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, compute_dtype: torch.dtype
    ) -> PackedWeight:
        def widened(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(compute_dtype)

        packed = torch.ops.mkldnn._reorder_linear_weight(widened(weight))
        plain = (weight.detach(), None if bias is None else bias.detach())
        return cls(packed, None if bias is None else widened(bias), compute_dtype, plain)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.compute_dtype and x.shape[0] < WIDENED_MIN_ROWS:
            return F.linear(x, *self.plain)
        out = torch.ops.mkldnn._linear_pointwise(
            x.to(self.compute_dtype), self.packed, self.bias, "none", [], ""
        )
        return out.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention over the new tokens plus the cached prefix.

    Writes the new tokens' K/V to their cache slots first, then attends per attention
    group (see batch.py): a fresh prefill attends over the new K/V directly; anything
    with a cached prefix gathers its blocks through the block table.
    """

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        """Attention output [T, hidden]."""
        batch = inputs.batch
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) * D]
        if batch.token_tables is not None:  # built for the paged kernel (the model checked)
            return self.o_proj(self._attend_paged(qkv, inputs))
        q, k, v = self._rotate_and_cache(qkv, inputs)
        outs = [
            self._attend(g, bias, q, k, v, inputs)
            for g, bias in zip(batch.groups, inputs.attn_biases, strict=True)
        ]
        return self.o_proj(outs[0] if len(outs) == 1 else torch.cat(outs))

    def _rotate_and_cache(
        self, qkv: torch.Tensor, inputs: LayerInputs
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q and k rotated, v: each [T, heads, D]; k and v also written to the cache."""
        t, heads, rope = qkv.shape[0], self.num_heads, inputs.rope
        qkv = qkv.view(t, -1, self.head_dim)  # [T, H + 2 Hkv, D]
        v = qkv[:, heads + self.num_kv_heads :]
        if self.q_norm is not None and self.k_norm is not None:
            q = apply_rotary(self.q_norm(qkv[:, :heads]), *rope)
            k = apply_rotary(self.k_norm(qkv[:, heads : heads + self.num_kv_heads]), *rope)
        else:  # rotate q and k in one pass: half the kernel launches of a decode step's RoPE
            qk = apply_rotary(qkv[:, : heads + self.num_kv_heads], *rope)
            q, k = qk[:, :heads], qk[:, heads:]
        inputs.kv.write(self.layer_idx, inputs.batch.slot_mapping, k, v)
        return q, k, v

    def _attend_paged(self, qkv: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        """Every query token over its sequence's cached keys, in one kernel call: [T, H * D].

        Without q/k norms the RoPE and the cache write are one kernel too.
        """
        batch, kv, kernels, t = inputs.batch, inputs.kv, inputs.kernels, qkv.shape[0]
        assert kernels is not None and kernels.paged_attention is not None
        assert batch.token_tables is not None and batch.token_kv_lens is not None
        layer_kv = kv.layer(self.layer_idx)
        if self.q_norm is None:
            cos, sin = (part.view(t, -1) for part in inputs.rope)
            q = kernels.rope_and_cache(qkv, cos, sin, layer_kv, batch.slot_mapping, self.num_heads)
        else:
            q = self._rotate_and_cache(qkv, inputs)[0]
        out = kernels.paged_attention(
            q.view(t, self.num_kv_heads, -1, self.head_dim),
            layer_kv,
            batch.token_tables,
            batch.token_kv_lens,
            kv.block_size,
            self.scale,
        )
        return out.view(t, -1)

    def _attend(
        self,
        g: AttentionGroup,
        bias: torch.Tensor | None,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        inputs: LayerInputs,
    ) -> torch.Tensor:
        """One group's attention output [g.end - g.start, H * D], through SDPA."""
        q, kv = q[g.start : g.end], inputs.kv
        if g.kv_spans is not None:
            return self._attend_spans(g.kv_spans, q, kv)
        if g.block_tables is None:
            keys = _pad(k[g.start : g.end], g).transpose(1, 2)
            values = _pad(v[g.start : g.end], g).transpose(1, 2)
        else:
            keys, values = kv.gather(self.layer_idx, g.block_tables)
            keys, values = keys[:, :, : g.key_len], values[:, :, : g.key_len]
        if g.max_q == 1:
            # Decode: the query heads sharing a KV head become that head's query rows,
            # so SDPA reads each K/V slab once without expanding it per query head.
            heads = q.view(g.num_seqs, self.num_kv_heads, -1, self.head_dim)
            out = F.scaled_dot_product_attention(
                heads, keys, values, attn_mask=bias, scale=self.scale
            )
            return out.reshape(g.num_seqs, -1)
        out = F.scaled_dot_product_attention(
            _pad(q, g).transpose(1, 2),
            keys,
            values,
            attn_mask=bias,
            is_causal=g.is_causal,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return _unpad(out.transpose(1, 2), g)

    def _attend_spans(
        self, spans: tuple[tuple[int, int], ...], q: torch.Tensor, kv: PagedKVCache
    ) -> torch.Tensor:
        """Decode attention straight over cache views, one call per sequence: [n, H * D].

        No gather copy, no padding and no mask, which beats one padded call when keys
        are long (see ``batch.SPAN_MIN_KEYS``). Query heads are grouped per KV head.
        """
        heads = q.view(len(spans), 1, self.num_kv_heads, -1, self.head_dim)
        outs = []
        for query, (first, length) in zip(heads, spans, strict=True):
            keys, values = kv.span(self.layer_idx, first, length)
            outs.append(F.scaled_dot_product_attention(query, keys, values, scale=self.scale))
        return torch.cat(outs).reshape(len(spans), -1)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor, kernels: CpuKernels | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if kernels is not None:
            return self.down_proj(kernels.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)).

    The residual stream travels beside the block's output, and each residual add is
    done by the norm that follows it (the next layer's, or the model's final norm), so
    on the CPU the add and the norm are one pass (``RMSNorm.add``).
    """

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, inputs: LayerInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual stream before it is added): the layer's
        output is their sum. ``residual`` None: ``x`` is the embeddings."""
        kernels = inputs.kernels
        if residual is None:
            h, residual = self.input_layernorm(x, kernels), x
        else:
            h, residual = self.input_layernorm.add(x, residual, kernels)
        h = self.self_attn(h, inputs)
        h, residual = self.post_attention_layernorm.add(h, residual, kernels)
        return self.mlp(h, kernels), residual


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


def _pad(x: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
    """Flat [T, H, D] -> [n, max_q, H, D] (a view when every sequence has max_q tokens)."""
    shape = (g.num_seqs, g.max_q, x.shape[1], x.shape[2])
    if g.query_index is None:
        return x.view(shape)
    padded = x.new_zeros((shape[0] * shape[1], shape[2], shape[3]))
    return padded.index_copy_(0, g.query_index, x).view(shape)


def _unpad(y: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
    """[n, max_q, H, D] -> flat [T, H * D], dropping padding queries."""
    flat = y.reshape(g.num_seqs * g.max_q, -1)
    return flat if g.query_index is None else flat.index_select(0, g.query_index)
