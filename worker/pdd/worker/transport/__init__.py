"""The worker data plane's transport: framed, authenticated, flow-controlled TCP
(TLS 1.3 on the channels that cross between the datacenters: ``pdd.common.wan_tls``).

Torch-free on purpose (the WAN link emulator and tests import it without the
inference core). Entry points: ``serve()``/``connect()`` give a ``Channel``.
The emulated WAN line it crosses in tests and ``pdd up`` is ``pdd.wan``.
"""

from pdd.common.wan_tls import TlsConfigError, WanTls, load_wan_tls
from pdd.worker.transport.channel import Channel
from pdd.worker.transport.config import TransportConfig
from pdd.worker.transport.counters import ByteCounters
from pdd.worker.transport.endpoints import Server, ServerStats, connect, serve
from pdd.worker.transport.errors import (
    AuthError,
    FrameError,
    LinkDown,
    TlsError,
    TransferTimeout,
    TransportError,
)
from pdd.worker.transport.framing import Frame, MsgType, request_key
from pdd.worker.transport.payloads import (
    TokenIds,
    decode_error,
    decode_json,
    decode_token_ids,
    encode_error,
    encode_json,
    encode_token_ids,
)

__all__ = [
    "AuthError",
    "ByteCounters",
    "Channel",
    "Frame",
    "FrameError",
    "LinkDown",
    "MsgType",
    "Server",
    "ServerStats",
    "TlsConfigError",
    "TlsError",
    "TokenIds",
    "TransferTimeout",
    "TransportConfig",
    "TransportError",
    "WanTls",
    "connect",
    "decode_error",
    "decode_json",
    "decode_token_ids",
    "encode_error",
    "encode_json",
    "encode_token_ids",
    "load_wan_tls",
    "request_key",
    "serve",
]
