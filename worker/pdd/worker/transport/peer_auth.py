"""Mutual shared-secret authentication: an HMAC challenge-response on connect.

    client -> HELLO {name, nonce_c, window}
    server -> AUTH  {name, nonce_s, window, proof_s = HMAC(k, "server" | nonce_c | nonce_s | names)}
    client -> AUTH  {proof_c = HMAC(k, "client" | nonce_s | nonce_c | names)}
    server -> ACK   (or ERROR, then close)

Both sides prove they hold the secret over a nonce the *other* side chose, so
a recorded handshake cannot be replayed, and the secret itself never crosses
the wire. The role label in each MAC keeps one side's proof from being
reflected back as the other's. Each side also learns the peer's receive
window, the initial flow-control credit.

Each exchange is also a round trip whose far side does only an HMAC in between, so
it is timed: the client gets two RTT samples (HELLO -> AUTH, AUTH -> ACK), the
server one (AUTH -> AUTH). Channels live one request each, so every request
measures its link's RTT without a frame of its own (see ``metering``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
from dataclasses import dataclass
from typing import TypeVar

from pdd.worker.transport.errors import AuthError, FrameError
from pdd.worker.transport.framing import Frame, MsgType
from pdd.worker.transport.payloads import decode_error, decode_json, encode_json
from pdd.worker.transport.stream import FrameStream

T = TypeVar("T")

_NONCE_BYTES = 32


@dataclass(frozen=True)
class PeerInfo:
    """Who is on the other end, once authenticated."""

    name: str
    window_bytes: int
    #: Round trips timed during the handshake, in seconds of the event loop's clock.
    rtt_samples: tuple[float, ...] = ()


def secret_bytes(secret: str | bytes) -> bytes:
    """The key as bytes; an empty secret is refused (it would authenticate anyone)."""
    key = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not key:
        raise ValueError("the transport shared secret is empty; set it (e.g. PDD_TRANSPORT_SECRET)")
    return key


def _proof(key: bytes, role: bytes, own_nonce: bytes, other_nonce: bytes, names: str) -> str:
    message = role + b"|" + other_nonce + b"|" + own_nonce + b"|" + names.encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


async def _expect(stream: FrameStream, msg_type: MsgType, max_bytes: int) -> Frame:
    frame = await stream.read(max_bytes, timeout_s=None)  # the caller bounds the whole handshake
    if frame.msg_type == MsgType.ERROR:
        try:
            info = decode_error(frame.payload)
        except FrameError as exc:
            raise AuthError(f"peer refused the handshake with a malformed ERROR: {exc}") from None
        raise AuthError(f"peer refused the handshake ({info.code}): {info.message}")
    if frame.msg_type != msg_type:
        raise AuthError(f"expected {msg_type.name} during handshake, got {frame.msg_type.name}")
    return frame


def _field(obj: dict, name: str, kind: type[T]) -> T:
    value = obj.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise FrameError(f"handshake field {name!r} missing or not {kind.__name__}")
    return value


def _name(obj: dict) -> str:
    """A peer's name: it enters the proof's message as UTF-8, so a lone surrogate (which
    JSON can carry) is refused here, not raised later as a UnicodeEncodeError."""
    name = str(_field(obj, "name", str))
    try:
        name.encode()
    except UnicodeEncodeError:
        raise FrameError("handshake field 'name' is not valid Unicode text") from None
    return name


def _proof_matches(expected: str, obj: dict) -> bool:
    """Constant-time check of the peer's ``proof``; a proof that is not an ASCII string
    (which ``hmac.compare_digest`` refuses with a TypeError) simply does not match."""
    given = str(_field(obj, "proof", str))
    return given.isascii() and hmac.compare_digest(expected.encode(), given.encode())


def _window(obj: dict) -> int:
    window = int(_field(obj, "window", int))
    if window <= 0:
        raise FrameError(f"handshake window must be positive, got {window}")
    return window


def _nonce(obj: dict, name: str) -> bytes:
    try:
        nonce = bytes.fromhex(str(_field(obj, name, str)))
    except ValueError:
        raise FrameError(f"handshake field {name!r} is not hex") from None
    if len(nonce) != _NONCE_BYTES:
        raise FrameError(f"handshake nonce {name!r} must be {_NONCE_BYTES} bytes")
    return nonce


async def client_handshake(
    stream: FrameStream, secret: bytes, name: str, window_bytes: int, max_bytes: int
) -> PeerInfo:
    """Authenticate to a server and verify it; raises ``AuthError`` on any mismatch."""
    nonce_c = os.urandom(_NONCE_BYTES)
    clock = asyncio.get_running_loop().time
    hello = {"name": name, "nonce": nonce_c.hex(), "window": window_bytes}
    started = clock()
    await stream.write(MsgType.HELLO, 0, encode_json(hello))
    challenge = decode_json((await _expect(stream, MsgType.AUTH, max_bytes)).payload)
    first_rtt = clock() - started
    server_name = _name(challenge)
    nonce_s = _nonce(challenge, "nonce")
    names = f"{name}|{server_name}"
    expected = _proof(secret, b"server", nonce_s, nonce_c, names)
    if not _proof_matches(expected, challenge):
        raise AuthError(
            f"server {server_name!r} at {stream.peer_address} failed to prove the shared "
            "secret: both ends must use the same transport secret"
        )
    proof_c = _proof(secret, b"client", nonce_c, nonce_s, names)
    started = clock()
    await stream.write(MsgType.AUTH, 0, encode_json({"proof": proof_c}))
    await _expect(stream, MsgType.ACK, max_bytes)
    return PeerInfo(server_name, _window(challenge), (first_rtt, clock() - started))


async def server_handshake(
    stream: FrameStream, secret: bytes, name: str, window_bytes: int, max_bytes: int
) -> PeerInfo:
    """Verify a connecting client; on failure tell it why and raise ``AuthError``."""
    hello = decode_json((await _expect(stream, MsgType.HELLO, max_bytes)).payload)
    client_name = _name(hello)
    nonce_c = _nonce(hello, "nonce")
    window = _window(hello)
    nonce_s = os.urandom(_NONCE_BYTES)
    names = f"{client_name}|{name}"
    proof_s = _proof(secret, b"server", nonce_s, nonce_c, names)
    challenge = {"name": name, "nonce": nonce_s.hex(), "window": window_bytes, "proof": proof_s}
    clock = asyncio.get_running_loop().time
    started = clock()
    await stream.write(MsgType.AUTH, 0, encode_json(challenge))
    answer = decode_json((await _expect(stream, MsgType.AUTH, max_bytes)).payload)
    rtt = clock() - started
    expected = _proof(secret, b"client", nonce_c, nonce_s, names)
    if not _proof_matches(expected, answer):
        raise AuthError(
            f"peer {client_name!r} at {stream.peer_address} failed the shared-secret check"
        )
    await stream.write(MsgType.ACK, 0)
    return PeerInfo(client_name, window, (rtt,))
