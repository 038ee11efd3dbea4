"""Loading the mounted WAN TLS Secret: a broken one is refused at start, naming the file;
mutual TLS follows what the certificate allows."""

from __future__ import annotations

import datetime
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdd.operator.builders.wan_tls import WanTlsMaterial
from pdd.worker.transport import TlsConfigError, load_wan_tls

pytestmark = pytest.mark.unit


def test_the_generated_secret_loads_with_mutual_tls(
    tmp_path: Path, deployment_tls, tls_files
) -> None:
    m: WanTlsMaterial = deployment_tls
    tls = load_wan_tls(tls_files(tmp_path, m.cert, m.key, m.ca))
    assert tls.mutual
    assert tls.server.verify_mode == ssl.CERT_REQUIRED
    assert tls.client.verify_mode == ssl.CERT_REQUIRED
    assert tls.server.minimum_version == tls.client.minimum_version == ssl.TLSVersion.TLSv1_3


def test_a_missing_file_or_a_foreign_key_is_named(
    tmp_path: Path, deployment_tls, other_tls, tls_files
) -> None:
    m: WanTlsMaterial = deployment_tls
    folder = tls_files(tmp_path / "a", m.cert, m.key, m.ca)
    (folder / "ca.crt").unlink()
    with pytest.raises(TlsConfigError, match=r"lacks ca\.crt"):
        load_wan_tls(folder)
    with pytest.raises(TlsConfigError, match="do not load as a certificate and key"):
        load_wan_tls(tls_files(tmp_path / "b", m.cert, other_tls.key, m.ca))
    with pytest.raises(TlsConfigError, match="not a PEM certificate"):
        load_wan_tls(tls_files(tmp_path / "c", "garbage", m.key, m.ca))


def test_a_server_only_certificate_turns_mutual_tls_off(tmp_path: Path, tls_files) -> None:
    """A cert-manager certificate issued with ``usages: [server auth]`` cannot authenticate
    a client: the server must not demand one (the HMAC handshake still checks clients)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "server-only")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM).decode()
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    tls = load_wan_tls(tls_files(tmp_path, pem, key_pem, pem))
    assert not tls.mutual
    assert tls.server.verify_mode == ssl.CERT_NONE
    assert tls.client.verify_mode == ssl.CERT_REQUIRED
