"""The WAN TLS Secret: a CA and one certificate the operator generates once per deployment.

Why one certificate for every worker: peers dial each other by pod IP and trust is
"chains to this deployment's CA" (see ``pdd.common.wan_tls``), so per-pod
certificates would add issuance on every pod start without adding a check. The CA's
private key is thrown away after signing: nothing else is ever issued from it, so it
cannot leak, and the CA is private to this deployment. The same Secret is written into
both clusters. Generation is the only impure step (like the shared token): the
reconciler reads the Secret back on every later reconcile, so it never changes, and
``build_wan_tls_secret`` stays a pure function of what it is given.

Users who rotate certificates (cert-manager) name their own Secret instead
(``spec.wan.tls.secretName``); workers read the files when they start.
"""

from __future__ import annotations

import base64
import datetime
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdd.common.wan_tls import CA_FILE, CERT_FILE, KEY_FILE, TLS_FILES
from pdd.operator.builders.meta import Site, metadata
from pdd.operator.naming import Owner
from pdd.operator.spec import PDDSpec

#: Validity of the generated CA and certificate: long, because nothing rotates them
#: (a user who needs rotation names a cert-manager Secret).
VALIDITY = datetime.timedelta(days=3650)


@dataclass(frozen=True)
class WanTlsMaterial:
    """The three PEM files of a WAN TLS Secret."""

    cert: str
    key: str
    ca: str

    def files(self) -> dict[str, str]:
        return {CERT_FILE: self.cert, KEY_FILE: self.key, CA_FILE: self.ca}


def generates_wan_tls(spec: PDDSpec) -> bool:
    """True when TLS is on and no user Secret is named: the operator makes the Secret."""
    return spec.wan.tls.enabled and spec.wan.tls.secret_name is None


def wan_tls_secret_name(spec: PDDSpec, owner: Owner) -> str | None:
    """The Secret worker pods mount for WAN TLS; None when TLS is off."""
    if not spec.wan.tls.enabled:
        return None
    return spec.wan.tls.secret_name or owner.wan_tls_secret_name


def new_wan_tls(deployment: str) -> WanTlsMaterial:
    """A fresh CA (its key discarded) and a certificate it signed, for server and client use."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"pdd {deployment} WAN CA")])
    ca = (
        _base(ca_name, ca_name, ca_key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(cert_sign=True), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"pdd {deployment} worker")])
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    cert = (
        _base(name, ca_name, key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(deployment)]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return WanTlsMaterial(
        cert=cert.public_bytes(serialization.Encoding.PEM).decode(),
        key=key_pem.decode(),
        ca=ca.public_bytes(serialization.Encoding.PEM).decode(),
    )


def _base(
    subject: x509.Name,
    issuer: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    now: datetime.datetime,
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # clock skew between clusters
        .not_valid_after(now + VALIDITY)
    )


def _usage(cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def wan_tls_of(secret: dict[str, Any] | None) -> WanTlsMaterial | None:
    """The material of an existing Secret; None when absent or missing a key."""
    data = (secret or {}).get("data") or {}
    if not all(data.get(name) for name in TLS_FILES):
        return None
    pem = {name: base64.b64decode(data[name]).decode() for name in TLS_FILES}
    return WanTlsMaterial(cert=pem[CERT_FILE], key=pem[KEY_FILE], ca=pem[CA_FILE])


def build_wan_tls_secret(owner: Owner, site: Site, material: WanTlsMaterial) -> dict[str, Any]:
    """The generated WAN TLS Secret (``kubernetes.io/tls``, plus ``ca.crt``)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(owner, "wan-tls", owner.wan_tls_secret_name, site),
        "type": "kubernetes.io/tls",
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in material.files().items()},
    }
