"""KV bytes per token for a model the operator cannot open.

The checkpoint lives on a volume or in an image the operator never mounts, so the
size comes from the spec: an explicit ``model.kvBytesPerToken`` (which wins, e.g. for
an fp8 KV cache on a bf16 checkpoint), or the four ``model.config`` fields, sized by
the shared cost model so the router and the operator count bytes the same way. What
crosses the WAN is that KV as ``spec.wan.kvCodec`` codes it.
"""

from __future__ import annotations

from pdd.common.cost_model import DTYPE_BYTES, kv_bytes_per_token
from pdd.common.kv_codec import NO_CODEC, KVCodecSetting, default_codec
from pdd.operator.spec import ModelSpec


def resolve_kv_bytes_per_token(model: ModelSpec) -> int | None:
    """The KV size per token, or None when the spec gives neither source."""
    if model.kv_bytes_per_token is not None:
        return model.kv_bytes_per_token
    shape = model.config
    if shape is None:
        return None
    return kv_bytes_per_token(
        shape.num_layers, shape.num_kv_heads, shape.head_dim, DTYPE_BYTES[shape.dtype]
    )


def resolve_wan_kv_bytes_per_token(model: ModelSpec, setting: KVCodecSetting) -> int | None:
    """The bytes per token MD's miss takes on the WAN under ``setting`` (spec.wan.kvCodec;
    adaptive: the exact codec's, the most a transfer takes, which the link is sized for).

    A codec's size depends on the shape (its scales are per head and channel), so a
    compressed link is sized from ``model.config``; None when the spec does not give it.
    """
    codec = default_codec(setting)
    if codec == NO_CODEC:
        return resolve_kv_bytes_per_token(model)
    shape = model.config
    if shape is None:
        return None
    return kv_bytes_per_token(
        shape.num_layers, shape.num_kv_heads, shape.head_dim, DTYPE_BYTES[shape.dtype], codec
    )
