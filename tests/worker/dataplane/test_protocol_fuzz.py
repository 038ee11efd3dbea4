"""The worker's framed protocol under fuzzing: the connection goes, the worker stays.

Hypothesis generates what a hostile or broken peer could send to a real ``pdd worker``
(MD's data port, the one that faces the WAN): raw bytes, headers with a wrong magic,
version, type, length or crc, streams cut inside a frame, a handshake with a forged
proof, and, after a real handshake, frames of every type carrying nonsense (binary, JSON
objects with unknown or half-valid operations, out-of-sequence or corrupt frames). After
every batch the worker must still be alive and answering, hold no request state, lock or
block, and have met no unexpected exception (a "transport handler failed" log line);
then a real request still serves. A slowloris peer (a partial header, then silence) is
dropped by the handshake timeout while real work goes on.
"""

from __future__ import annotations

import asyncio
import json
import struct
import zlib

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdd.worker.roles.protocol import split_addr
from pdd.worker.transport import ByteCounters, MsgType, TransportError
from pdd.worker.transport.framing import HEADER, MAGIC, VERSION
from pdd.worker.transport.peer_auth import client_handshake, secret_bytes
from pdd.worker.transport.stream import FrameStream

pytestmark = pytest.mark.slow

TARGET = "md"
#: Cases per attack family; five families make 2,500 hostile connections.
CASES = 500
#: Only a hang reaches it: the worker answers or closes at once.
BACKSTOP_S = 60.0
HANDLER_FAILED = "transport handler failed"
OPS = ("prepare", "kv", "handoff", "cancel", "launch_missiles", "", None, 7)


def frame_bytes(msg_type: int, request_id: int, seq: int, payload: bytes, **bad: int) -> bytes:
    """A frame as the wire carries it; ``bad`` overrides header fields (version, length,
    crc, magic as an int) to make it wrong in one chosen way."""
    crc = bad.get("crc", zlib.crc32(payload))
    length = bad.get("length", len(payload))
    magic = struct.pack("<I", bad["magic"]) if "magic" in bad else MAGIC
    version = bad.get("version", VERSION)
    return HEADER.pack(magic, version, msg_type, 0, request_id, seq, length, crc) + payload


u8, u32, u64 = (st.integers(0, 2**n - 1) for n in (8, 32, 64))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
json_messages = st.fixed_dictionaries(
    {"op": st.sampled_from(OPS)},
    optional={"request_id": json_values, "plan": json_values, "tokens": json_values},
).map(lambda obj: json.dumps(obj).encode())
payloads = st.binary(max_size=2048) | json_messages


@st.composite
def broken_headers(draw) -> bytes:
    """One frame made wrong in one field (or cut short), before any handshake."""
    payload = draw(payloads)
    wrong = draw(st.sampled_from(["magic", "version", "type", "length", "crc", "cut"]))
    bad: dict[str, int] = {}
    msg_type = int(MsgType.HELLO)
    if wrong == "magic":
        bad["magic"] = draw(u32.filter(lambda m: struct.pack("<I", m) != MAGIC))
    elif wrong == "version":
        bad["version"] = draw(u8.filter(lambda v: v != VERSION))
    elif wrong == "type":
        msg_type = draw(u8)
    elif wrong == "length":
        bad["length"] = draw(u32)
    elif wrong == "crc":
        bad["crc"] = draw(u32.filter(lambda c: c != zlib.crc32(payload)))
    raw = frame_bytes(msg_type, draw(u64), 0, payload, **bad)
    return raw[: draw(st.integers(0, len(raw) - 1))] if wrong == "cut" else raw


@st.composite
def nonsense_frames(draw) -> list[tuple[int, int, bytes]]:
    """Well-framed (type, request key, payload) triples of any type, nonsense inside."""
    types = st.sampled_from([int(t) for t in MsgType])
    return draw(st.lists(st.tuples(types, u64, payloads), min_size=1, max_size=6))


@pytest.fixture(scope="module")
def target(dp):
    worker = dp.cluster[TARGET]
    return worker, split_addr(worker.endpoint.fast_addr)


def failures_logged(worker) -> int:
    return worker.log.read_text(errors="replace").count(HANDLER_FAILED)


async def send_and_drain(host: str, port: int, data: bytes) -> None:
    """Send ``data`` on a fresh connection and read until the worker closes it."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        await writer.drain()
        writer.write_eof()
        await asyncio.wait_for(reader.read(), BACKSTOP_S)
    except (ConnectionError, OSError):
        pass  # the worker dropped it before we were done: what it should do
    finally:
        writer.close()


async def after_handshake(host: str, port: int, secret: str, frames, tail: bytes) -> None:
    """A real handshake, then ``frames`` (well framed, in sequence), then ``tail`` raw."""
    reader, writer = await asyncio.open_connection(host, port)
    stream = FrameStream(reader, writer, ByteCounters(), BACKSTOP_S)
    try:
        await client_handshake(stream, secret_bytes(secret), "fuzzer", 1 << 20, 1 << 16)
        for msg_type, key, payload in frames:
            stream.write_nowait(MsgType(msg_type), key, payload)
        writer.write(tail)
        await writer.drain()
        writer.write_eof()
        await asyncio.wait_for(reader.read(), BACKSTOP_S)
    except (ConnectionError, OSError, TransportError):
        pass  # the worker dropped it before we were done: what it should do
    finally:
        writer.close()


def fuzz(strategy, attack) -> None:
    @settings(
        max_examples=CASES,
        deadline=None,
        database=None,
        derandomize=True,  # the same cases every run: a failure reproduces
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def one(case) -> None:
        asyncio.run(attack(case))

    one()


async def assert_unharmed(dp, worker, failures_before: int) -> None:
    assert worker.proc.poll() is None, f"the worker died:\n{worker.log_tail()}"
    assert httpx.get(f"{worker.url}/health", timeout=10).status_code == 200
    await dp.assert_quiescent()
    assert failures_logged(worker) == failures_before, worker.log_tail(60)


@pytest.mark.timeout(1200)  # 2,500 connections: about 90 s idle, several times that busy
def test_hostile_peers_are_dropped_and_the_worker_serves_on(dp, target) -> None:
    worker, (host, port) = target
    secret = dp.cluster.secret
    before = failures_logged(worker)

    fuzz(st.binary(min_size=1, max_size=4096), lambda data: send_and_drain(host, port, data))
    fuzz(broken_headers(), lambda data: send_and_drain(host, port, data))

    async def forged_proof(proof: str) -> None:
        hello = {"name": "forger", "nonce": "00" * 32, "window": 1 << 20}
        data = frame_bytes(MsgType.HELLO, 0, 0, json.dumps(hello).encode())
        data += frame_bytes(MsgType.AUTH, 0, 1, json.dumps({"proof": proof}).encode())
        await send_and_drain(host, port, data)

    fuzz(st.text(max_size=80), forged_proof)
    fuzz(nonsense_frames(), lambda frames: after_handshake(host, port, secret, frames, b""))
    corrupt = st.tuples(nonsense_frames(), broken_headers())
    fuzz(corrupt, lambda case: after_handshake(host, port, secret, case[0], case[1]))
    asyncio.run(assert_unharmed(dp, worker, before))


async def test_a_slowloris_peer_is_dropped_while_real_requests_serve(dp, target) -> None:
    worker, (host, port) = target
    before = failures_logged(worker)
    stalled = [await asyncio.open_connection(host, port) for _ in range(50)]
    for _, writer in stalled:
        writer.write(MAGIC + bytes([VERSION]))  # 5 of a header's bytes, then nothing
        await writer.drain()
    prompt = dp.prompts(1, seed=77)[0]
    [reference] = await dp.reference([prompt], 8, "slowloris")
    plan = dp.cluster.plan("slowloris-0", prompt, "P-MD", dp.sampling(0, 8), main=TARGET)
    [run] = await dp.run_all([plan])
    assert run.token_ids == reference  # served while 50 connections hang on the worker
    answers = await asyncio.gather(
        *(asyncio.wait_for(reader.read(), BACKSTOP_S) for reader, _ in stalled)
    )  # read to EOF: the handshake timeout ends each, none waits for the backstop
    assert all(b"handshake did not complete within connect_timeout_s" in a for a in answers)
    for _, writer in stalled:
        writer.close()
    await assert_unharmed(dp, worker, before)
