"""The KV codecs' arithmetic: compress a chunk's KV for the WAN, restore it on arrival.

The geometry (scale groups, scale dtype, bits) is ``pdd.common.kv_codec``'s; this
module is its torch side, vectorized over every layer, head, channel and token at
once (no Python loop per head or token), run on the engine's device so only the
compressed bytes are copied off it.

Payload of a compressed chunk of ``n`` tokens, ``g = ceil(n / GROUP_TOKENS)``:
the codes ``[L, 2, n, Hkv, D]`` (one byte each; int4: two per byte, low nibble
first), then the key scales ``[L, g, Hkv, D]``, then the value scales ``[L, g, Hkv]``,
both bfloat16. Codes are symmetric: ``x ~= code * scale``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdd.common.kv_codec import CODEC_BITS, GROUP_TOKENS, NO_CODEC, KVCodec

SCALE_DTYPE = torch.bfloat16
#: The largest code magnitude per codec (fp8: e4m3's largest finite value).
_QMAX = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}
#: Raises a scale before it is rounded to bfloat16 (8 significant bits, so rounding moves
#: it by at most 2**-8), so the rounded scale never falls below amax / qmax and no code
#: is clipped.
_ROUND_UP = 1.0 + 2.0**-7


def fp8_supported() -> bool:
    """Whether this torch has float8 e4m3 (the ``fp8`` codec needs it on both ends)."""
    return hasattr(torch, "float8_e4m3fn")


def encode(data: torch.Tensor, codec: KVCodec) -> bytes:
    """``data`` ``[L, 2, n, Hkv, D]`` as ``codec``'s payload bytes."""
    if codec == NO_CODEC:
        return _bytes(data)
    x = data.detach().float()
    n = x.shape[2]
    keys, values = _grouped(x[:, 0]), _grouped(x[:, 1])  # [L, g, G, Hkv, D]
    k_scale = _scale(keys.abs().amax(dim=2), codec)  # [L, g, Hkv, D]
    v_scale = _scale(values.abs().amax(dim=(2, 4)), codec)  # [L, g, Hkv]
    scaled = torch.stack(
        (
            _ungrouped(keys / k_scale.float()[:, :, None], n),
            _ungrouped(values / v_scale.float()[:, :, None, :, None], n),
        ),
        dim=1,
    )
    return _bytes(_codes(scaled, codec)) + _bytes(k_scale) + _bytes(v_scale)


def decode(
    payload: bytes, codec: KVCodec, shape: tuple[int, ...], dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:  # fmt: skip
    """The KV ``[L, 2, n, Hkv, D]`` in ``dtype`` on ``device`` from ``encode``'s bytes
    (whose size the caller checked against ``chunk_wire_bytes``)."""
    num_layers, _, n, heads, head_dim = shape
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    if codec == NO_CODEC:
        return raw.view(dtype).reshape(shape)
    groups = -(-n // GROUP_TOKENS)
    n_codes = 2 * num_layers * n * heads * head_dim * CODEC_BITS[codec] // 8
    n_k = num_layers * groups * heads * head_dim * 2
    codes = raw[:n_codes]
    k_scale = raw[n_codes : n_codes + n_k].view(SCALE_DTYPE).view(num_layers, groups, heads, -1)
    v_scale = raw[n_codes + n_k :].view(SCALE_DTYPE).view(num_layers, groups, heads)
    x = _values(codes, codec).view(shape)
    keys = _grouped(x[:, 0]) * k_scale.float()[:, :, None]
    values = _grouped(x[:, 1]) * v_scale.float()[:, :, None, :, None]
    return torch.stack((_ungrouped(keys, n), _ungrouped(values, n)), dim=1).to(dtype)


def _grouped(t: torch.Tensor) -> torch.Tensor:
    """``[L, n, Hkv, D]`` -> ``[L, g, GROUP_TOKENS, Hkv, D]``, the last group zero-padded
    (a zero never raises a group's largest magnitude)."""
    num_layers, n, heads, head_dim = t.shape
    pad = -n % GROUP_TOKENS
    if pad:
        t = F.pad(t, (0, 0, 0, 0, 0, pad))
    return t.reshape(num_layers, -1, GROUP_TOKENS, heads, head_dim)


def _ungrouped(t: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of ``_grouped``: ``[L, g, G, Hkv, D]`` -> ``[L, n, Hkv, D]``."""
    num_layers, _, _, heads, head_dim = t.shape
    return t.reshape(num_layers, -1, heads, head_dim)[:, :n]


def _scale(amax: torch.Tensor, codec: KVCodec) -> torch.Tensor:
    """Per-group scales in bfloat16, never zero (an all-zero group codes to zeros)."""
    scale = (amax * (_ROUND_UP / _QMAX[codec])).to(SCALE_DTYPE)
    return scale.clamp(min=torch.finfo(SCALE_DTYPE).tiny)


def _codes(scaled: torch.Tensor, codec: KVCodec) -> torch.Tensor:
    """Values already divided by their scale -> the codes, one uint8 per byte on the wire."""
    qmax = _QMAX[codec]
    if codec == "fp8":
        return scaled.clamp(-qmax, qmax).to(torch.float8_e4m3fn).view(torch.uint8)
    codes = scaled.round().clamp(-qmax, qmax)
    if codec == "int8":
        return codes.to(torch.int8).view(torch.uint8)
    nibbles = (codes + 8).to(torch.uint8).reshape(-1, 2)  # int4: 1..15, two per byte
    return nibbles[:, 0] | (nibbles[:, 1] << 4)


def _values(codes: torch.Tensor, codec: KVCodec) -> torch.Tensor:
    """Inverse of ``_codes``: the codes as float32 multiples of their scale (flat)."""
    if codec == "fp8":
        return codes.view(torch.float8_e4m3fn).float()
    if codec == "int8":
        return codes.view(torch.int8).float()
    nibbles = torch.stack((codes & 0x0F, codes >> 4), dim=1).reshape(-1)
    return nibbles.float() - 8


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
