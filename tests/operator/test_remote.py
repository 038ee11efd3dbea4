"""The cluster B client comes from a kubeconfig: static credentials only."""

from __future__ import annotations

import pytest
import yaml

from pdd.operator.remote import RemoteClusterUnavailable, connection_from_kubeconfig

pytestmark = pytest.mark.unit


def kubeconfig(user: dict) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "b",
            "contexts": [{"name": "b", "context": {"cluster": "b", "user": "u", "namespace": "x"}}],
            "clusters": [{"name": "b", "cluster": {"server": "https://b.example:6443",
                                                    "certificate-authority-data": "Q0E="}}],
            "users": [{"name": "u", "user": user}],
        }
    )  # fmt: skip


def test_token_kubeconfig() -> None:
    info = connection_from_kubeconfig(kubeconfig({"token": "abc"}))
    assert info.server == "https://b.example:6443"
    assert info.token == "abc" and info.ca_data == "Q0E=" and info.default_namespace == "x"
    assert info.as_http_headers() == {"Authorization": "Bearer abc"}


def test_exec_plugins_are_refused_with_the_alternative() -> None:
    with pytest.raises(RemoteClusterUnavailable, match="ServiceAccount token"):
        connection_from_kubeconfig(kubeconfig({"exec": {"command": "aws"}}))


def test_broken_kubeconfig_names_the_fix() -> None:
    with pytest.raises(RemoteClusterUnavailable, match="kubectl config view --minify --flatten"):
        connection_from_kubeconfig("current-context: nowhere\n")
