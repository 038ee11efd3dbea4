"""KV codecs for the WAN path: their names and the wire geometry every component shares.

P compresses the KV it ships to MD across the WAN (only there: the in-datacenter path
to the relay stays exact) and MD restores it in its engine's dtype. The worker does the
arithmetic (``pdd.worker.engine.kv_codec``, torch); this module says how many bytes a
chunk takes, so the worker's payload check, the router's transfer estimate and the
operator's link sizing count the same bytes. Pure Python, no torch.

Geometry: every K or V vector (one token, one KV head, one layer) is coded on its
own, centred: a scale and a centre per vector, both bfloat16, and codes for the
vector minus its centre. No scale spans tokens, so a chunk's size is exact per token
whatever its length (P's chunks of a large model hold only a few tokens), and one loud
token never coarsens its neighbours. The centre takes out a vector's offset (biased
K projections, as in Qwen2), so the codes only have to cover its spread. Measured on
the test checkpoints this halves int8's KL from exact against one scale per 64 tokens
(docs/kv-codec.md#quality).
"""

from __future__ import annotations

from typing import Literal, cast

KVCodec = Literal["none", "fp8", "int8", "int4"]
#: Every codec, lossless first.
KV_CODECS: tuple[KVCodec, ...] = ("none", "fp8", "int8", "int4")
#: The exact codec: the KV crosses in the engine's own dtype.
NO_CODEC: KVCodec = "none"

#: What a deployment sets (``spec.wan.kvCodec``, ``--kv-codec``): one codec for every
#: transfer, or ``adaptive``: the router picks one per transfer (``ADAPTIVE_CODECS``).
KVCodecSetting = Literal["none", "fp8", "int8", "int4", "adaptive"]
ADAPTIVE: KVCodecSetting = "adaptive"
#: Every setting; the CRD's ``spec.wan.kvCodec`` enum lists the same.
KV_CODEC_SETTINGS: tuple[KVCodecSetting, ...] = (*KV_CODECS, ADAPTIVE)
#: What ``adaptive`` chooses from, least lossy first: the router takes the first whose
#: transfer fits the TTFT budget at the live link estimate (the soonest where none
#: does). fp8 is left out: int8 takes the same bytes and keeps more of the KV.
ADAPTIVE_CODECS: tuple[KVCodec, ...] = ("none", "int8", "int4")
#: MD computes its miss from the prompt's IDs itself (nothing but the request crosses,
#: nothing is lost) where the miss is at most this many tokens and that is sooner than
#: the exact KV's crossing (under any codec), and under adaptive where it fits the budget
#: before the lossy codecs: the default of ``--md-recompute-max-tokens``. It bounds the
#: prefill a decode instance takes on beside its batch: eight of its steps at the
#: workers' default 512-token step budget.
MD_RECOMPUTE_MAX_TOKENS = 4096

#: The coded layout; bump it when the codes or scales change, so that a P and an MD of
#: different builds name different codecs in the handshake instead of misreading bytes.
CODEC_FORMAT = 2
#: Per coded vector (one token's K or V of one head in one layer): a scale and a centre.
PARAMS_PER_VECTOR = 2
#: Bytes of one scale or centre (bfloat16).
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


def parse_kv_codec_setting(name: str) -> KVCodecSetting:
    """``name`` as a ``KVCodecSetting``, or an error listing the settings there are."""
    if name not in KV_CODEC_SETTINGS:
        raise UnknownCodecError(f"unknown KV codec {name!r}; known: {', '.join(KV_CODEC_SETTINGS)}")
    return cast(KVCodecSetting, name)


def default_codec(setting: KVCodecSetting) -> KVCodec:
    """The codec a setting stands for where no transfer names one: the link is sized
    for it, and P sends it when a plan does not say (adaptive: the exact one)."""
    return NO_CODEC if setting == ADAPTIVE else cast(KVCodec, setting)


def takes_codec(setting: KVCodecSetting, codec: KVCodec) -> bool:
    """An MD set to ``setting`` decodes KV coded ``codec``: its own codec, or any the
    router may choose under adaptive."""
    return codec in ADAPTIVE_CODECS if setting == ADAPTIVE else codec == setting


def shared_in_receiver_cache(codec: KVCodec, setting: KVCodecSetting) -> bool:
    """A receiver keeps KV that crossed coded ``codec`` in its prefix cache for later
    requests to hit: only the exact KV, or the one codec a deployment set for every
    transfer (then every request's KV is coded alike and reusing it changes nothing).

    Under ``adaptive`` a lossy codec is chosen for one transfer, because the line was
    slow then: its KV, and everything the receiver computes on top of it, stays that
    request's own. Were it cached, every later turn of the conversation would attend
    to the approximate prefix and keep deviating from an exact run after the line
    recovered (the prefix-cache key says which tokens, not how their KV was made;
    vLLM's ``cache_salt`` and LMCache's format-qualified keys keep such KV apart the
    same way). The router's index counts it as MD's only when this says so."""
    return codec in (NO_CODEC, setting)


def codec_of_handshake(name: object) -> KVCodec | None:
    """The codec a ``prepare`` names (``handshake_name``), None for one of another build
    or none at all."""
    return next((c for c in KV_CODECS if handshake_name(c) == name), None)


def handshake_name(codec: KVCodec) -> str:
    """What ``prepare`` and ``prepared`` call ``codec``: its name and, for a lossy one, the
    coded layout's version (``int8.v2``), so that peers of different builds fail the
    handshake by name rather than misreading each other's bytes."""
    return codec if codec == NO_CODEC else f"{codec}.v{CODEC_FORMAT}"


def chunk_wire_bytes(
    codec: KVCodec, num_layers: int, num_tokens: int, num_kv_heads: int, head_dim: int,
    dtype_bytes: int,
) -> int:  # fmt: skip
    """Payload bytes of a chunk of ``num_tokens`` tokens' KV (K and V, every layer)."""
    elements = 2 * num_layers * num_tokens * num_kv_heads * head_dim
    if codec == NO_CODEC:
        return elements * dtype_bytes
    vectors = 2 * num_layers * num_tokens * num_kv_heads
    return elements * CODEC_BITS[codec] // 8 + vectors * PARAMS_PER_VECTOR * SCALE_BYTES
