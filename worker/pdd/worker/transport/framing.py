"""The frame: a fixed 28-byte binary header followed by the payload.

Header (little-endian): ``magic "PDDT" | u8 version | u8 type | u16 flags |
u64 request_id | u32 seq | u32 payload_length | u32 crc32(payload)``.

Everything is checked before a byte of payload is trusted: the magic and
version (a foreign or future speaker), the type (unknown types are rejected,
not skipped, so a protocol mismatch fails loudly), the length against the
receiver's limit *before* reading the payload (a lying length cannot make the
receiver allocate gigabytes) and the crc after. ``seq`` counts the frames a
channel has sent; the receiver checks it so a dropped or reordered frame is an
error rather than silently corrupt KV.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import struct
import zlib
from dataclasses import dataclass

from pdd.worker.transport.errors import FrameError

MAGIC = b"PDDT"
VERSION = 1
HEADER = struct.Struct("<4sBBHQIII")
HEADER_SIZE = HEADER.size
MAX_REQUEST_ID = (1 << 64) - 1


class MsgType(enum.IntEnum):
    """What a frame carries. The numbers are wire values: never renumber."""

    HELLO = 1  # handshake: client nonce, name, receive window
    AUTH = 2  # handshake: challenge / proof
    KV_CHUNK = 3  # one chunk of a request's KV (see pdd.worker.engine.kv_transfer)
    KV_DONE = 4  # all KV of a request has been sent
    TOKEN_IDS = 5  # token-ID handoff (see payloads.encode_token_ids)
    ACK = 6  # application acknowledgement of a request
    CREDIT = 7  # flow control: the receiver consumed this many bytes
    ERROR = 8  # utf-8 JSON {"code", "message"}; see payloads.encode_error
    CLOSE = 9  # orderly end of the channel
    META = 10  # utf-8 JSON metadata (request id string, sizes, layout)


@dataclass(frozen=True)
class Frame:
    """One decoded frame. ``payload`` is the exact bytes the sender passed."""

    msg_type: MsgType
    request_id: int
    seq: int
    payload: bytes
    flags: int = 0

    @property
    def wire_size(self) -> int:
        return HEADER_SIZE + len(self.payload)


def encode_header(
    msg_type: MsgType, request_id: int, seq: int, payload: bytes | memoryview, flags: int = 0
) -> bytes:
    """The header for ``payload``; the payload itself is written separately (no copy)."""
    if not 0 <= request_id <= MAX_REQUEST_ID:
        raise ValueError(f"request_id {request_id} does not fit u64; use request_key(str)")
    return HEADER.pack(
        MAGIC, VERSION, int(msg_type), flags, request_id, seq, len(payload), zlib.crc32(payload)
    )


def encode_frame(frame: Frame) -> bytes:
    """Header and payload as one bytes object (tests and small control frames)."""
    header = encode_header(frame.msg_type, frame.request_id, frame.seq, frame.payload, frame.flags)
    return header + frame.payload


@dataclass(frozen=True)
class Header:
    msg_type: MsgType
    flags: int
    request_id: int
    seq: int
    length: int
    crc: int


def decode_header(raw: bytes, max_payload: int) -> Header:
    """Validate and decode a header; raises ``FrameError`` saying which check failed."""
    magic, version, type_, flags, request_id, seq, length, crc = HEADER.unpack(raw)
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r} (expected {MAGIC!r}): peer is not a PDD transport")
    if version != VERSION:
        raise FrameError(f"unsupported frame version {version} (this side speaks {VERSION})")
    try:
        msg_type = MsgType(type_)
    except ValueError:
        raise FrameError(f"unknown message type {type_}") from None
    if length > max_payload:
        raise FrameError(
            f"frame payload of {length} bytes exceeds max_frame_bytes={max_payload}; "
            "raise the receiver's limit or send smaller chunks"
        )
    return Header(msg_type, flags, request_id, seq, length, crc)


async def read_frame(reader: asyncio.StreamReader, max_payload: int) -> Frame | None:
    """Read one frame; ``None`` on a clean end of stream between frames.

    A stream that ends inside a frame is a ``FrameError`` (truncated), not an EOF.
    """
    try:
        raw = await reader.readexactly(HEADER_SIZE)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise FrameError(f"truncated header: {len(exc.partial)} of {HEADER_SIZE} bytes") from None
    header = decode_header(raw, max_payload)
    try:
        payload = await reader.readexactly(header.length) if header.length else b""
    except asyncio.IncompleteReadError as exc:
        raise FrameError(
            f"truncated payload: {len(exc.partial)} of {header.length} bytes"
        ) from None
    if zlib.crc32(payload) != header.crc:
        raise FrameError(f"crc mismatch on a {header.msg_type.name} frame: corrupted in transit")
    return Frame(header.msg_type, header.request_id, header.seq, payload, header.flags)


def request_key(request_id: str) -> int:
    """A stable u64 for a string request id (the header field is a u64).

    The string itself travels in a META frame; the key only tags frames.
    """
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")
