"""Shared fixtures for the operator tests: example CRs and their parsed specs, and one
Kubernetes emulator (cluster A) that kubeconfig points at."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import kmock
import pytest
import yaml

from pdd.operator.naming import Owner
from pdd.operator.spec import PDDSpec
from pdd.testing.kube_emulator import emulator, kubeconfig

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "pdddeployments.yaml"


def load_cr(name: str) -> dict[str, Any]:
    return yaml.safe_load((DATA / name).read_text())


@pytest.fixture
def pool_b_cr() -> dict[str, Any]:
    return load_cr("pool-b.yaml")


@pytest.fixture
def remote_cr() -> dict[str, Any]:
    return load_cr("remote.yaml")


@pytest.fixture
def pool_b_spec(pool_b_cr: dict[str, Any]) -> PDDSpec:
    return PDDSpec.model_validate(pool_b_cr["spec"])


@pytest.fixture
def remote_spec(remote_cr: dict[str, Any]) -> PDDSpec:
    return PDDSpec.model_validate(remote_cr["spec"])


@pytest.fixture
def owner() -> Owner:
    return Owner(name="qwen", namespace="serving", uid="0b9e7c1e-0000-4000-8000-000000000001")


@pytest.fixture
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


@pytest.fixture
async def cluster_a(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[kmock.KubernetesEmulator, httpx.AsyncClient]]:
    """An emulated cluster and a client of its API; ``KUBECONFIG`` names it."""
    async with emulator() as (k8s, url), httpx.AsyncClient(base_url=url) as client:
        path = tmp_path / "kubeconfig"
        path.write_text(kubeconfig(url))
        monkeypatch.setenv("KUBECONFIG", str(path))
        yield k8s, client
