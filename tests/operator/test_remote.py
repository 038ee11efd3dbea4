"""Clients come from kubernetes_asyncio's loaders: kubeconfig users of every kind (cluster
B's Secret) and the pod's service account (cluster A). Exec plugins against a live API
are in test_operator_kmock.py (they run a process)."""

from __future__ import annotations

import base64
import datetime
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from pdd.operator.kube import KubeApi
from pdd.operator.remote import RemoteClusterUnavailable, client_from_kubeconfig

pytestmark = pytest.mark.unit


def kubeconfig(user: dict, cluster: dict | None = None) -> str:
    cluster = cluster or {"server": "http://b.example:6443"}
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "b",
            "contexts": [{"name": "b", "context": {"cluster": "b", "user": "u", "namespace": "x"}}],
            "clusters": [{"name": "b", "cluster": cluster}],
            "users": [{"name": "u", "user": user}],
        }
    )


def self_signed() -> tuple[bytes, bytes]:
    """A certificate and its key, PEM: what a client certificate user or a CA holds."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdd-operator")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


async def test_a_token_user_authenticates_every_request() -> None:
    api = await client_from_kubeconfig(kubeconfig({"token": "abc"}))
    try:
        info = api.connection_info()
        assert info.server == "http://b.example:6443" == api.server
        assert info.as_http_headers() == {"Authorization": "Bearer abc"}
    finally:
        await api.aclose()


async def test_a_client_certificate_user_and_an_inline_ca_are_loaded() -> None:
    cert, key = self_signed()
    b64 = lambda data: base64.b64encode(data).decode()  # noqa: E731
    user = {"client-certificate-data": b64(cert), "client-key-data": b64(key)}
    cluster = {"server": "https://b.example:6443", "certificate-authority-data": b64(cert)}
    api = await client_from_kubeconfig(kubeconfig(user, cluster))
    try:
        info = api.connection_info()
        assert info.token is None
        assert info.certificate_path and Path(info.certificate_path).read_bytes() == cert
        assert info.private_key_path and Path(info.private_key_path).read_bytes() == key
        assert info.ca_path and Path(info.ca_path).read_bytes() == cert
    finally:
        await api.aclose()


async def test_broken_kubeconfigs_name_the_fix() -> None:
    with pytest.raises(RemoteClusterUnavailable, match="kubectl config view --minify --flatten"):
        await client_from_kubeconfig("current-context: nowhere\n")
    with pytest.raises(RemoteClusterUnavailable, match="kubectl config view --minify --flatten"):
        await client_from_kubeconfig(kubeconfig({"token": "abc"}).replace("current-context", "x"))
    with pytest.raises(RemoteClusterUnavailable, match="not YAML"):
        await client_from_kubeconfig("{{{")
    # An exec plugin without its command: the loader's own message, and where to look.
    with pytest.raises(RemoteClusterUnavailable, match=r"exec.*command") as caught:
        await client_from_kubeconfig(kubeconfig({"exec": {"apiVersion": "v1"}}))
    assert "operator's image" in str(caught.value)


async def test_in_cluster_the_pods_service_account_is_used(tmp_path: Path) -> None:
    cert, _ = self_signed()
    (tmp_path / "token").write_text("sa-token")
    (tmp_path / "ca.crt").write_bytes(cert)
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    api = await KubeApi.local(service_account=tmp_path, environ=env)
    try:
        info = api.connection_info()
        assert info.server == "https://10.96.0.1:443"
        assert info.as_http_headers() == {"Authorization": "Bearer sa-token"}
        assert info.ca_path == str(tmp_path / "ca.crt")
    finally:
        await api.aclose()


async def test_outside_a_cluster_kubeconfig_is_read_when_asked_not_at_import(
    tmp_path: Path,
) -> None:
    path = tmp_path / "config"
    path.write_text(kubeconfig({"token": "laptop"}))
    api = await KubeApi.local(service_account=tmp_path / "none", environ={"KUBECONFIG": str(path)})
    try:
        assert api.connection_info().as_http_headers() == {"Authorization": "Bearer laptop"}
    finally:
        await api.aclose()
