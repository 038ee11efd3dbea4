"""TLS for the channels that cross between the datacenters (the WAN port and WAN dials).

Why only those: in-datacenter channels (P -> RLD KV) stay on the datacenter's own
network, where encrypting ~GB/s of KV would cost CPU for no threat the operator's
network policy does not already cover; the WAN channels (P -> MD KV, MD <-> RLD
handoff) cross public networks between cities. TLS 1.3 only (no downgrade, one round
trip, AEAD ciphers that modern CPUs run at GB/s).

Trust is the deployment's CA (``ca.crt``), not host names: peers dial each other by
pod IP (advertised in the plan), which no certificate names, so the hostname check is
off and a peer is accepted when its certificate chains to that CA. The CA is private
to the deployment when the operator generates it; when a user's Secret chains to a
wider CA (a company issuer), the HMAC shared-secret handshake that still runs inside
TLS keeps other holders of that CA's certificates out. Mutual TLS (the server asks for
and checks the client's certificate) is on when the certificate may be used as a client
one (no extended key usage, or ``clientAuth`` among them); otherwise only the server is
verified by certificate and the client by the HMAC handshake.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from pdd.common.wan_tls import CA_FILE, CERT_FILE, KEY_FILE, TLS_FILES


class TlsConfigError(ValueError):
    """The TLS folder is missing a file, or a file is not usable; the message says which."""


@dataclass(frozen=True)
class WanTls:
    """The two sides' contexts, built once from the mounted files."""

    server: ssl.SSLContext
    client: ssl.SSLContext
    #: Whether the server demands and verifies a client certificate.
    mutual: bool


def load_wan_tls(folder: Path) -> WanTls:
    """Contexts from ``folder``'s ``tls.crt``, ``tls.key`` and ``ca.crt``.

    Raises ``TlsConfigError`` naming the file and the problem, so a worker with a
    broken Secret says so at start instead of failing every transfer later.
    """
    missing = [name for name in TLS_FILES if not (folder / name).is_file()]
    if missing:
        raise TlsConfigError(f"WAN TLS folder {folder} lacks {', '.join(missing)}")
    cert, key, ca = folder / CERT_FILE, folder / KEY_FILE, folder / CA_FILE
    mutual = allows_client_auth(cert.read_bytes(), cert)
    server = _context(ssl.PROTOCOL_TLS_SERVER, cert, key, ca)
    server.verify_mode = ssl.CERT_REQUIRED if mutual else ssl.CERT_NONE
    client = _context(ssl.PROTOCOL_TLS_CLIENT, cert, key, ca)
    client.check_hostname = False  # peers are dialled by pod IP: trust is the CA (above)
    client.verify_mode = ssl.CERT_REQUIRED
    return WanTls(server, client, mutual)


def allows_client_auth(pem: bytes, where: Path) -> bool:
    """True when the certificate may authenticate a client (mutual TLS)."""
    try:
        certificate = x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise TlsConfigError(f"{where} is not a PEM certificate: {exc}") from None
    try:
        usages = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return True
    return ExtendedKeyUsageOID.CLIENT_AUTH in usages


def _context(protocol: int, cert: Path, key: Path, ca: Path) -> ssl.SSLContext:
    context = ssl.SSLContext(protocol)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    try:
        context.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise TlsConfigError(
            f"{cert} and {key} do not load as a certificate and key: {exc}"
        ) from None
    try:
        context.load_verify_locations(cafile=ca)
    except (ssl.SSLError, OSError) as exc:
        raise TlsConfigError(f"{ca} does not load as a CA certificate: {exc}") from None
    return context


#: OpenSSL's reasons for a refused handshake, in words.
_REFUSALS = {
    "TLSV1_ALERT_UNKNOWN_CA": "the peer does not trust our certificate (not from its CA)",
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": "the peer requires a client certificate",
    "SSLV3_ALERT_BAD_CERTIFICATE": "the peer refused our certificate",
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": "the peer presented no certificate (mutual TLS)",
    "WRONG_VERSION_NUMBER": "the peer does not speak TLS (plaintext on a TLS port?)",
}


def tls_failure(exc: BaseException) -> str:
    """A TLS handshake failure in words: which side's certificate, and OpenSSL's reason."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (
            "TLS handshake failed: the peer's certificate does not chain to the deployment's "
            f"CA ({exc.verify_message})"
        )
    reason = getattr(exc, "reason", None)
    if reason in _REFUSALS:
        return f"TLS handshake failed: {_REFUSALS[reason]} ({reason})"
    if reason is None and isinstance(exc, ConnectionError | EOFError):
        return (
            "TLS handshake failed: the peer closed the connection (does it trust our "
            f"certificate? its log says why) ({type(exc).__name__})"
        )
    return f"TLS handshake failed: {reason or exc or type(exc).__name__}"
