"""The KV codecs' arithmetic: compress a chunk's KV for the WAN, restore it on arrival.

The geometry (one scale and one centre per K or V vector, bits) is
``pdd.common.kv_codec``'s; this module is its torch side, vectorized over every
layer, head and token at once (no Python loop per head or token), run on the
engine's device so only the compressed bytes are copied off it.

Payload of a compressed chunk of ``n`` tokens: the codes ``[L, 2, n, Hkv, D]`` (one
byte each; int4: two per byte, low nibble first), then the scales ``[L, 2, n, Hkv]``,
then the centres ``[L, 2, n, Hkv]``, both bfloat16. ``x ~= centre + code * scale``,
codes symmetric about zero.
"""

from __future__ import annotations

import torch

from pdd.common.kv_codec import CODEC_BITS, NO_CODEC, SCALE_BYTES, KVCodec

SCALE_DTYPE = torch.bfloat16
#: The largest code magnitude per codec (fp8: e4m3's largest finite value).
_QMAX = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}
#: Raises a scale before it is rounded to bfloat16 (8 significant bits, so rounding moves
#: it by at most 2**-8), so the rounded scale never falls below spread / qmax and no code
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
    high, low = x.amax(dim=-1), x.amin(dim=-1)  # [L, 2, n, Hkv]
    # The centre is rounded first and the scale measured from the rounded centre, so
    # the centre's bfloat16 rounding widens the range a little but never clips a code.
    centre = ((high + low) / 2).to(SCALE_DTYPE)
    spread = torch.maximum(high - centre.float(), centre.float() - low)
    scale = (spread * (_ROUND_UP / _QMAX[codec])).to(SCALE_DTYPE)
    scale = scale.clamp(min=torch.finfo(SCALE_DTYPE).tiny)  # a constant vector: codes 0
    scaled = (x - centre.float()[..., None]) / scale.float()[..., None]
    return _bytes(_codes(scaled, codec)) + _bytes(scale) + _bytes(centre)


def decode(
    payload: bytes, codec: KVCodec, shape: tuple[int, ...], dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:  # fmt: skip
    """The KV ``[L, 2, n, Hkv, D]`` in ``dtype`` on ``device`` from ``encode``'s bytes
    (whose size the caller checked against ``chunk_wire_bytes``)."""
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    if codec == NO_CODEC:
        return raw.view(dtype).reshape(shape)
    vectors = shape[:-1]  # [L, 2, n, Hkv]
    n_codes = torch.Size(shape).numel() * CODEC_BITS[codec] // 8
    n_params = torch.Size(vectors).numel() * SCALE_BYTES
    scale = raw[n_codes : n_codes + n_params].view(SCALE_DTYPE).view(vectors).float()
    centre = raw[n_codes + n_params :].view(SCALE_DTYPE).view(vectors).float()
    x = _values(raw[:n_codes], codec).view(shape)
    return (x * scale[..., None] + centre[..., None]).to(dtype)


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
