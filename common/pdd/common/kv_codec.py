"""KV codecs for the WAN path: their names and the wire geometry every component shares.

P compresses the KV it ships to MD across the WAN (only there: the in-datacenter path
to the relay stays exact) and MD restores it in its engine's dtype. The worker does the
arithmetic (``pdd.worker.engine.kv_codec``, torch); this module says how many bytes a
chunk takes, so the worker's payload check, the router's transfer estimate and the
operator's link sizing count the same bytes. Pure Python, no torch.

Geometry (symmetric quantization, no zero points, so scales stay cheap): a chunk's
tokens are cut into groups of ``GROUP_TOKENS`` (the last one may be short). Keys get
a scale per (layer, group, KV head, channel): key outliers sit in fixed channels, so a
per-channel scale keeps one loud channel from flattening the others. Values get a scale
per (layer, group, KV head). Scales are bfloat16 (float32's range, half the bytes).
"""

from __future__ import annotations

import math
from typing import Literal, cast

KVCodec = Literal["none", "fp8", "int8", "int4"]
#: Every codec, lossless first; the CRD's ``spec.wan.kvCodec`` enum lists the same.
KV_CODECS: tuple[KVCodec, ...] = ("none", "fp8", "int8", "int4")
#: The exact codec: the KV crosses in the engine's own dtype.
NO_CODEC: KVCodec = "none"

#: Tokens that share one scale. 64 puts the scales at 1/32 byte per key element, which
#: keeps int8 under 0.52x and int4 under 0.28x of bfloat16 KV while each group is still
#: short enough that one loud token does not coarsen a long run of quiet ones.
GROUP_TOKENS = 64
#: Bytes of one scale (bfloat16).
SCALE_BYTES = 2
#: Bits per quantized element.
CODEC_BITS: dict[str, int] = {"fp8": 8, "int8": 8, "int4": 4}


class UnknownCodecError(ValueError):
    """A codec name none of the KV codecs answers to."""


def parse_kv_codec(name: str) -> KVCodec:
    """``name`` as a ``KVCodec``, or an error listing the codecs there are."""
    if name not in KV_CODECS:
        raise UnknownCodecError(f"unknown KV codec {name!r}; known: {', '.join(KV_CODECS)}")
    return cast(KVCodec, name)


def chunk_wire_bytes(
    codec: KVCodec, num_layers: int, num_tokens: int, num_kv_heads: int, head_dim: int,
    dtype_bytes: int,
) -> int:  # fmt: skip
    """Payload bytes of a chunk of ``num_tokens`` tokens' KV (K and V, every layer)."""
    elements = 2 * num_layers * num_tokens * num_kv_heads * head_dim
    if codec == NO_CODEC:
        return elements * dtype_bytes
    groups = math.ceil(num_tokens / GROUP_TOKENS)
    scales = num_layers * groups * num_kv_heads * (head_dim + 1)  # K per channel, V per head
    return elements * CODEC_BITS[codec] // 8 + scales * SCALE_BYTES
