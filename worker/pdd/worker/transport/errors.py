"""Typed transport errors: every way a transfer can end badly has its own name.

Callers branch on the type (retry on ``LinkDown``, give up on ``AuthError``),
and every message says what happened and what to check, so a failed transfer
never ends as a hang or a bare ``OSError``.
"""

from __future__ import annotations


class TransportError(Exception):
    """Base of every data-plane transport failure.

    After ``FrameError``, ``AuthError`` or ``LinkDown`` the channel is gone. After
    ``TransferTimeout`` it is still open (no frame was cut in half): the caller
    decides whether to wait again or close it.
    """


class FrameError(TransportError):
    """The peer sent bytes that are not a valid frame (magic, length, crc, type, order)."""


class AuthError(TransportError):
    """The peer failed (or refused) the shared-secret handshake."""


class TlsError(AuthError):
    """TLS failed: a certificate not from the deployment's CA, none where one is required,
    or the peer's TLS aborted the connection."""


class LinkDown(TransportError):
    """The connection was closed or reset by the peer or the network."""


class TransferTimeout(TransportError):
    """No progress within the configured timeout: the link is cut or the peer is stuck."""
