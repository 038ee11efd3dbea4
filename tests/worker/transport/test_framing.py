"""Frame encoding and the checks a receiver runs before trusting a byte."""

from __future__ import annotations

import asyncio
import struct
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdd.worker.transport.errors import FrameError
from pdd.worker.transport.framing import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    VERSION,
    Frame,
    MsgType,
    encode_frame,
    read_frame,
    request_key,
)
from pdd.worker.transport.payloads import (
    decode_error,
    decode_json,
    decode_token_ids,
    encode_error,
    encode_token_ids,
)

pytestmark = pytest.mark.unit

MAX = 1 << 16


def _reader(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def _raw_header(**overrides: int | bytes) -> bytes:
    fields = {
        "magic": MAGIC,
        "version": VERSION,
        "type": int(MsgType.KV_CHUNK),
        "flags": 0,
        "request_id": 7,
        "seq": 0,
        "length": 3,
        "crc": zlib.crc32(b"abc"),
    }
    fields.update(overrides)
    return HEADER.pack(*fields.values())


frames = st.builds(
    Frame,
    msg_type=st.sampled_from(list(MsgType)),
    request_id=st.integers(0, (1 << 64) - 1),
    seq=st.integers(0, (1 << 32) - 1),
    payload=st.binary(max_size=4096),
    flags=st.integers(0, (1 << 16) - 1),
)


@given(frames)
def test_round_trip_preserves_every_field(frame: Frame) -> None:
    async def go() -> None:
        reader = _reader(encode_frame(frame) + encode_frame(frame))
        assert await read_frame(reader, MAX) == frame
        assert await read_frame(reader, MAX) == frame
        assert await read_frame(reader, MAX) is None  # clean end between frames

    asyncio.run(go())


def test_header_is_fixed_size() -> None:
    frame = Frame(MsgType.ACK, 1, 2, b"xyz")
    assert len(encode_frame(frame)) == HEADER_SIZE + 3 == frame.wire_size


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (_raw_header(magic=b"HTTP") + b"abc", "bad magic"),
        (_raw_header(version=VERSION + 1) + b"abc", "unsupported frame version"),
        (_raw_header(type=200) + b"abc", "unknown message type 200"),
        (_raw_header(crc=zlib.crc32(b"abd")) + b"abc", "crc mismatch"),
        (_raw_header()[:10], "truncated header"),
        (_raw_header() + b"ab", "truncated payload"),
    ],
)
async def test_malformed_frames_are_rejected(raw: bytes, message: str) -> None:
    with pytest.raises(FrameError, match=message):
        await read_frame(_reader(raw), MAX)


async def test_oversize_length_is_rejected_before_reading_the_payload() -> None:
    # No payload bytes and no EOF follow: a receiver that tried to read them would hang.
    reader = _reader(_raw_header(length=MAX + 1), eof=False)
    with pytest.raises(FrameError, match="exceeds max_frame_bytes"):
        await asyncio.wait_for(read_frame(reader, MAX), timeout=5)


@given(st.integers(0, 1 << 20), st.lists(st.integers(0, (1 << 32) - 1), max_size=500))
def test_token_ids_round_trip_at_four_bytes_per_token(start: int, ids: list[int]) -> None:
    payload = encode_token_ids(start, ids)
    assert len(payload) == 8 + 4 * len(ids)
    decoded = decode_token_ids(payload)
    assert (decoded.start, decoded.ids) == (start, ids)


def test_token_ids_little_endian_on_the_wire() -> None:
    assert encode_token_ids(5, [1, 0x01020304]) == struct.pack("<IIII", 5, 2, 1, 0x01020304)


def test_token_ids_count_mismatch_is_rejected() -> None:
    payload = encode_token_ids(0, [1, 2, 3])
    with pytest.raises(FrameError, match="says 3 ids"):
        decode_token_ids(payload[:-4])
    with pytest.raises(FrameError, match="shorter than its header"):
        decode_token_ids(b"\x00")


def test_error_and_json_payloads() -> None:
    info = decode_error(encode_error("kv_missing", "prefix evicted"))
    assert (info.code, info.message) == ("kv_missing", "prefix evicted")
    with pytest.raises(FrameError, match="not JSON"):
        decode_json(b"\xff")
    with pytest.raises(FrameError, match="must be an object"):
        decode_json(b"[1]")


def test_request_key_is_a_stable_u64() -> None:
    key = request_key("chatcmpl-123")
    assert key == request_key("chatcmpl-123") != request_key("chatcmpl-124")
    assert 0 <= key < 1 << 64
    with pytest.raises(ValueError, match="does not fit u64"):
        encode_frame(Frame(MsgType.ACK, 1 << 64, 0, b""))
