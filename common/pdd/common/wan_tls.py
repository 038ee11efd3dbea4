"""TLS for the channels that cross between the datacenters, shared by workers and the router.

Which channels: the data plane's WAN port and WAN dials (P -> MD KV, MD <-> RLD
handoff), and the control API of the workers the router reaches across the WAN
(``HTTPS_ROLES``: MD's token stream, ``/handoff``, ``/load``, ``/health``, cache
events). In-datacenter channels (P -> RLD KV, the router's calls to P and RLD) stay on
the datacenter's own network, where encrypting ~GB/s of KV would cost CPU for no
threat the operator's network policy does not already cover. TLS 1.3 only (no
downgrade, one round trip, AEAD ciphers that modern CPUs run at GB/s).

Trust is the deployment's CA (``ca.crt``), not host names: peers dial each other by
pod IP (advertised in the plan, resolved from a headless Service), which no certificate
names, so the hostname check is off and a peer is accepted when its certificate chains
to that CA. The CA is private to the deployment when the operator generates it; when a
user's Secret chains to a wider CA (a company issuer), the shared secret still
authenticates the caller (the HMAC handshake inside TLS on the data plane, the bearer
token on the control API), which keeps other holders of that CA's certificates out.

Mutual TLS: on the data plane it is on when the certificate may be used as a client one
(no extended key usage, or ``clientAuth`` among them); otherwise only the server is
verified by certificate and the client by the HMAC handshake. On the control API it is
never asked for: kubelet's HTTPS probes and Prometheus's scrapes present no client
certificate (kubelet cannot be given one), and the router would need the workers'
private key; the bearer secret authenticates the router there.

The files' layout is cert-manager's (``tls.crt``, ``tls.key``, ``ca.crt``), so a Secret
that cert-manager issues can be named in ``spec.wan.tls.secretName`` as it is; the
operator's own generated Secret uses the same keys. Mounted as a volume, each key is a
file of the same name in the folder given with ``--wan-tls-dir``.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from pdd.common.vocabulary import Role

#: This instance's certificate chain (PEM), presented as server and, for mutual TLS, client.
CERT_FILE = "tls.crt"
#: The private key of ``CERT_FILE`` (PEM).
KEY_FILE = "tls.key"
#: The deployment's CA (PEM): a peer's certificate must chain to it.
CA_FILE = "ca.crt"
#: Every key a WAN TLS Secret must hold.
TLS_FILES = (CERT_FILE, KEY_FILE, CA_FILE)

#: The roles whose HTTP control API the router (datacenter A, beside P and RLD) reaches
#: across the WAN: with WAN TLS on they serve it over TLS and the router dials https.
HTTPS_ROLES = frozenset({Role.MAIN})


class TlsConfigError(ValueError):
    """The TLS folder is missing a file, or a file is not usable; the message says which."""


@dataclass(frozen=True)
class WanTls:
    """A worker's contexts, built once from the mounted files."""

    #: The WAN data port's side: asks for a client certificate when ``mutual``.
    server: ssl.SSLContext
    #: Dials to peers' WAN data ports: presents the certificate, verifies the peer's.
    client: ssl.SSLContext
    #: Whether the data port demands and verifies a client certificate.
    mutual: bool
    #: The control API's side (``HTTPS_ROLES``): the certificate, no client certificate asked.
    http_server: ssl.SSLContext
    #: Where the files were read (a mounted Secret: ``TlsRotation`` watches it).
    folder: Path

    @property
    def contexts(self) -> tuple[ssl.SSLContext, ...]:
        return (self.server, self.client, self.http_server)


def load_wan_tls(folder: Path) -> WanTls:
    """Contexts from ``folder``'s ``tls.crt``, ``tls.key`` and ``ca.crt``.

    Raises ``TlsConfigError`` naming the file and the problem, so a worker with a
    broken Secret says so at start instead of failing every transfer later.
    """
    _require(folder, TLS_FILES)
    cert, key, ca = folder / CERT_FILE, folder / KEY_FILE, folder / CA_FILE
    mutual = allows_client_auth(cert.read_bytes(), cert)
    server = _context(ssl.PROTOCOL_TLS_SERVER, ca, (cert, key))
    server.verify_mode = ssl.CERT_REQUIRED if mutual else ssl.CERT_NONE
    client = _context(ssl.PROTOCOL_TLS_CLIENT, ca, (cert, key))
    client.check_hostname = False  # peers are dialled by pod IP: trust is the CA (above)
    client.verify_mode = ssl.CERT_REQUIRED
    http_server = _context(ssl.PROTOCOL_TLS_SERVER, ca, (cert, key))
    http_server.verify_mode = ssl.CERT_NONE  # probes and scrapes have no certificate
    return WanTls(server, client, mutual, http_server, folder)


def load_wan_ca(folder: Path) -> ssl.SSLContext:
    """The router's client context: a worker's certificate must chain to ``folder``'s
    ``ca.crt`` (the only file the router is given: the key stays with the workers)."""
    _require(folder, (CA_FILE,))
    client = _context(ssl.PROTOCOL_TLS_CLIENT, folder / CA_FILE)
    client.check_hostname = False  # workers are dialled by pod IP: trust is the CA
    client.verify_mode = ssl.CERT_REQUIRED
    return client


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


def _require(folder: Path, names: tuple[str, ...]) -> None:
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise TlsConfigError(f"WAN TLS folder {folder} lacks {', '.join(missing)}")


def _context(protocol: int, ca: Path, chain: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    context = ssl.SSLContext(protocol)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    if chain is not None:
        cert, key = chain
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
