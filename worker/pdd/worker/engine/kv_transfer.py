"""The KV transfer wire format: self-describing chunks of one request's KV.

A chunk carries the KV of tokens ``[start, end)`` for every layer, as one
contiguous tensor ``[num_layers, 2 (k, v), n, num_kv_heads, head_dim]`` in the
sender's dtype, or compressed by the KV codec the header names
(``pdd.worker.engine.kv_codec``: P -> MD across the WAN, when the deployment opts
in; the receiver restores its own dtype). The layout is per token, not per block, so sender and
receiver may use different block sizes. Each chunk stands alone (header +
payload), so a receiver can import chunks as they stream in and a corrupt or
foreign chunk is rejected before it touches the pool.

Bytes: ``MAGIC | u32 header_len | header JSON | payload``. The header names
the model fingerprint, dtype, layout, the token range, a digest of the token
IDs ``[0, end)`` (KV depends on the whole prefix, so the receiver checks it
holds the same one), the codec and a CRC32 of the payload.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

import torch

from pdd.common.kv_codec import NO_CODEC, KVCodec, chunk_wire_bytes
from pdd.worker.engine import kv_codec
from pdd.worker.model.kv_cache import KVLayout

MAGIC = b"PDDKV\x01"
LAYOUT = "layer,kv,token,kv_head,head_dim"
_LEN = struct.Struct("<I")


class KVTransferError(Exception):
    """A KV chunk cannot be imported; the engine state is unchanged."""


class MalformedChunkError(KVTransferError):
    """The bytes are not a KV chunk of this format version."""


class ChecksumError(KVTransferError):
    """The payload does not match its checksum: corrupted in transit."""


class FingerprintMismatchError(KVTransferError):
    """The chunk comes from a different model (config fingerprint differs)."""


class DtypeMismatchError(KVTransferError):
    """The chunk's KV dtype differs from the receiver's KV cache dtype."""


class LayoutMismatchError(KVTransferError):
    """The chunk's KV shape (layers, kv heads, head dim) differs from the receiver's."""


class CodecMismatchError(KVTransferError):
    """The chunk is coded with another KV codec than the one the handshake agreed."""


class KVRangeError(KVTransferError):
    """The chunk's token range does not continue what the receiver holds."""


class KVGapError(KVRangeError):
    """The chunk starts past what the receiver holds: the tokens between are missing
    (they may still come: a sender that started from a predicted hit sends them after)."""


class TokenMismatchError(KVTransferError):
    """The chunk's KV was computed for a different token prefix than the receiver's request."""


@dataclass(frozen=True)
class KVChunkHeader:
    fingerprint: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    start: int
    end: int
    prefix_digest: str  # sha256 of the token IDs [0, end)
    checksum: int  # crc32 of the payload
    layout: str = LAYOUT
    codec: KVCodec = NO_CODEC

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_tokens, self.num_kv_heads, self.head_dim)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def prefix_digest(token_ids: Sequence[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}I", *token_ids)).hexdigest()


def encode_chunk(
    data: torch.Tensor, start: int, fingerprint: str, prefix_token_ids: Sequence[int],
    codec: KVCodec = NO_CODEC,
) -> bytes:  # fmt: skip
    """Serialize ``data`` ``[L, 2, n, Hkv, D]`` holding the KV of tokens ``[start, start+n)``.

    ``prefix_token_ids`` are the request's token IDs ``[0, start+n)``.
    """
    num_layers, _, n, num_kv_heads, head_dim = data.shape
    payload = kv_codec.encode(data, codec)
    header = KVChunkHeader(
        fingerprint=fingerprint,
        dtype=dtype_name(data.dtype),
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        start=start,
        end=start + n,
        prefix_digest=prefix_digest(prefix_token_ids),
        checksum=zlib.crc32(payload),
        codec=codec,
    )
    head = json.dumps(asdict(header), separators=(",", ":")).encode()
    return MAGIC + _LEN.pack(len(head)) + head + payload


def decode_chunk(blob: bytes) -> tuple[KVChunkHeader, bytes]:
    """Split a chunk into its header and verified payload; raises on any damage."""
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + _LEN.size:
        raise MalformedChunkError("not a PDD KV chunk (bad magic or truncated header)")
    (head_len,) = _LEN.unpack_from(blob, len(MAGIC))
    body = len(MAGIC) + _LEN.size + head_len
    try:
        header = KVChunkHeader(**json.loads(blob[len(MAGIC) + _LEN.size : body]))
    except (ValueError, TypeError) as exc:
        raise MalformedChunkError(f"unreadable KV chunk header: {exc}") from exc
    payload = blob[body:]
    if zlib.crc32(payload) != header.checksum:
        raise ChecksumError(
            f"KV chunk [{header.start}, {header.end}) failed its checksum: corrupted in transit; "
            "resend it"
        )
    return header, payload


def check_compatible(
    header: KVChunkHeader, fingerprint: str, dtype: torch.dtype, shape: tuple[int, int, int],
    codec: KVCodec = NO_CODEC,
) -> None:  # fmt: skip
    """Raise the typed error for the first way the chunk does not fit this receiver."""
    if header.codec != codec:
        raise CodecMismatchError(
            f"KV chunk is coded {header.codec}, the transfer agreed on {codec}; "
            "the sender must code what its handshake named"
        )
    if header.fingerprint != fingerprint:
        raise FingerprintMismatchError(
            f"KV chunk is from model {header.fingerprint}, this engine serves {fingerprint}; "
            "send it to an instance of the same model"
        )
    if header.dtype != dtype_name(dtype):
        raise DtypeMismatchError(
            f"KV chunk dtype is {header.dtype}, this engine's KV cache is {dtype_name(dtype)}; "
            "run both instances with the same --dtype"
        )
    theirs = (header.num_layers, header.num_kv_heads, header.head_dim)
    if header.layout != LAYOUT or theirs != shape:
        raise LayoutMismatchError(
            f"KV chunk layout {header.layout} {theirs} does not match this engine's {LAYOUT} "
            f"{shape} (layers, kv heads, head dim)"
        )


def payload_tensor(
    header: KVChunkHeader, payload: bytes, device: torch.device | str
) -> torch.Tensor:
    """The chunk's KV as a tensor ``[L, 2, n, Hkv, D]`` in its dtype on ``device``."""
    dtype = getattr(torch, header.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = chunk_wire_bytes(
        header.codec, header.num_layers, header.num_tokens, header.num_kv_heads,
        header.head_dim, itemsize,
    )  # fmt: skip
    if len(payload) != expected:
        raise MalformedChunkError(
            f"KV chunk payload is {len(payload)} bytes, its header promises shape "
            f"{header.shape} coded {header.codec} ({expected} bytes)"
        )
    return kv_codec.decode(payload, header.codec, header.shape, dtype, device)


class TokenKVWriter(Protocol):
    """What ``import_chunk`` writes into: the engine's ``PagedKVCache``, or vLLM's caches
    seen the same way (``vllm.paged_view.VllmPagedKV``, ``vllm.token_kv.TokenKV``)."""

    @property
    def layout(self) -> KVLayout: ...

    @property
    def device(self) -> torch.device: ...

    def write_tokens(
        self, block_table: Sequence[int], start: int, data: torch.Tensor, /
    ) -> None: ...


def import_chunk(
    kv: TokenKVWriter,
    block_table: Sequence[int],
    token_ids: Sequence[int],
    num_held: int,
    blob: bytes,
    fingerprint: str,
    codec: KVCodec = NO_CODEC,
) -> int:
    """Write what chunk ``blob`` adds past the ``num_held`` tokens held; returns the new count.

    The receiver's table must cover ``token_ids`` (the tokens whose KV it expects).
    A chunk may overlap what is held (the held part, maybe shared with the prefix
    cache, is never overwritten); one past a gap raises ``KVGapError``, so a receiver
    can keep it until the tokens between arrive. ``codec`` is the one the
    transfer's handshake agreed on. Raises a ``KVTransferError`` subclass before
    writing anything.
    """
    header, payload = decode_chunk(blob)
    layout = kv.layout
    shape = (layout.num_layers, layout.num_kv_heads, layout.head_dim)
    check_compatible(header, fingerprint, layout.dtype, shape, codec)
    if header.end > len(token_ids) or header.start >= header.end:
        raise KVRangeError(
            f"KV chunk covers [{header.start}, {header.end}) but the receiver expects KV "
            f"within [0, {len(token_ids)}) (the attached tokens)"
        )
    if header.prefix_digest != prefix_digest(token_ids[: header.end]):
        raise TokenMismatchError(
            f"KV chunk [{header.start}, {header.end}) was computed for other token IDs than this "
            "request's; attach the request with the sender's exact token IDs"
        )
    if header.start > num_held:
        raise KVGapError(
            f"KV chunk covers [{header.start}, {header.end}) but the receiver holds "
            f"[0, {num_held}) of {len(token_ids)} expected tokens: [{num_held}, {header.start}) "
            "never arrived; send the chunks in between too"
        )
    if header.end <= num_held:
        return num_held
    data = payload_tensor(header, payload, kv.device)
    kv.write_tokens(block_table, num_held, data[:, :, num_held - header.start :])
    return header.end
