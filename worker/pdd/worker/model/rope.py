"""Rotary position embeddings with the scaling variants Llama 3 and Qwen checkpoints use.

The cos/sin tables are computed once per model for every position up to
``max_position_embeddings`` (fp32, half the head dim), so a forward step only indexes
them by position: no trigonometry and no allocation proportional to the context.
The inverse-frequency formulas follow transformers' ``modeling_rope_utils`` exactly,
because parity with transformers is how the decoder is tested.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pdd.worker.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies [head_dim/2] and the cos/sin scale for this config.

    Computed on the CPU explicitly (not the default device), so the tables come out
    right even while the model's modules are being built under ``torch.device("meta")``.

    "dynamic" NTK scaling equals plain RoPE for positions inside
    ``max_position_embeddings`` (transformers only rescales beyond it, per call, which a
    paged cache cannot follow because cached keys keep their old rotation); the engine
    never admits longer contexts, so "dynamic" is served as "default".
    """
    dim = config.head_dim
    base_inv = _base_inverse_frequencies(config.rope_theta, dim)
    params: dict[str, Any] = dict(config.rope_scaling or {})
    rope_type = params.get("rope_type", "default")
    if rope_type in ("default", "dynamic"):
        return base_inv, 1.0
    if rope_type == "linear":
        return base_inv / float(params["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3(base_inv, params), 1.0
    if rope_type == "yarn":
        return _yarn(config, params)
    raise ValueError(f"unknown rope type {rope_type!r}")  # config.py rejects these earlier


class RotaryEmbedding:
    """Precomputed cos/sin tables, rotating q and k in place of a per-step computation.

    A plain object rather than an ``nn.Module`` so that building the model on the meta
    device (to load weights without a random init) leaves these tables intact.
    """

    def __init__(self, config: ModelConfig, device: torch.device | str) -> None:
        inv_freq, scale = inverse_frequencies(config)
        inv_freq = inv_freq.to(device)
        positions = torch.arange(config.max_position_embeddings, device=device).float()
        freqs = torch.outer(positions, inv_freq)
        self.cos = freqs.cos() * scale  # [max_pos, head_dim/2], fp32
        self.sin = freqs.sin() * scale

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for these positions, shaped [T, 1, head_dim/2] to broadcast over heads."""
        return (
            self.cos.index_select(0, positions).to(dtype).unsqueeze(1),
            self.sin.index_select(0, positions).to(dtype).unsqueeze(1),
        )


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, H, D] by position (the "rotate half" convention of HF Llama weights)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _base_inverse_frequencies(theta: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (theta**exponents)


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, blend in between."""
    factor, low, high = (
        float(p["factor"]),
        float(p["low_freq_factor"]),
        float(p["high_freq_factor"]),
    )
    old_context = float(p["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(config: ModelConfig, p: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, rescale attention."""
    dim, base = config.head_dim, config.rope_theta
    original = float(p["original_max_position_embeddings"])
    factor = p.get("factor") or config.max_position_embeddings / original
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = torch.clamp((ramp - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
