"""A worker whose port was taken between ``free_port`` and its bind is started again.

``free_port`` can only promise that a port was free a moment ago; another suite or the
other pytest worker may bind it first. Here the first port handed out is one this test
holds open, so the worker's first start must fail with "address already in use" and
the cluster must start it again on fresh ports.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from pdd.local import cluster as local_cluster
from pdd.local.cluster import LocalCluster, WorkerSpec

pytestmark = pytest.mark.integration


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_worker_that_lost_its_port_is_started_again(taken_port, tmp_path, monkeypatch) -> None:
    real_free_port = local_cluster.free_port
    handed = iter([taken_port])  # the worker's http port, the first time only
    monkeypatch.setattr(local_cluster, "free_port", lambda: next(handed, None) or real_free_port())
    common = ["--model", "tiny", "--num-blocks", "64"]
    c = LocalCluster.start([WorkerSpec("p", "prefill")], tmp_path, common_args=common)
    try:
        assert c["p"].url != f"http://127.0.0.1:{taken_port}"
        assert c["p"].proc.poll() is None
    finally:
        c.stop()


def test_free_ports_lie_below_the_ephemeral_range_and_are_not_handed_out_twice() -> None:
    """An outgoing connection cannot take a port we handed out before its process binds it."""
    low, _ = local_cluster.ephemeral_range()
    ports = [local_cluster.free_port() for _ in range(200)]
    assert all(1024 <= p < low for p in ports)
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # and it was free
